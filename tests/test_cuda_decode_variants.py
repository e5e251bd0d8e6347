"""lab/cuda_decode_variants.py: the committed per-variant counts and predictions are the model's,
its ring arithmetic is the kernel's (as the emulator mirrors it), and the variants are priced by
their own launch structure (no GPU, no compiler: the committed counts)."""

import pytest

from lab.cuda_decode_variants import (
    OUT_JSON, SHAPES, VARIANTS, predict, stage_bytes, stages_built, variant_launches,
)
from lab.decode_time_model import STATIC_JSON, Params, load
from tests.cuda_decode_emulator import stage_layout
from tests.cuda_decode_emulator import stages_built as emulated_stages_built


@pytest.fixture(scope="module")
def committed():
    return load(OUT_JSON)


def test_ring_arithmetic_is_the_kernels():
    for D in (64, 128, 256):
        for KB, VB in ((2, 2), (2, 4), (4, 2), (4, 4)):
            assert stage_bytes(D, KB, VB) == stage_layout(D, KB, VB)[-1]
            for stages in (1, 2, 4):
                assert stages_built(stages, D, KB, VB) == emulated_stages_built(stages, D, KB, VB)


def test_committed_predictions_are_the_models(committed):
    params, tail = Params(**committed["meta"]["params"]), load(STATIC_JSON)["cuda_cpp"]
    assert [r["variant"] for r in committed["rows"]] == list(VARIANTS)
    for row in committed["rows"]:
        assert predict(row, tail, params) == row["predictions"], row["variant"]


def test_variants_change_the_launch_as_built(committed):
    rows = {r["variant"]: r for r in committed["rows"]}
    tail = load(STATIC_JSON)["cuda_cpp"]
    B, Hq, H, L = SHAPES[0]  # batch 8, 32/32 heads, 1K
    default, residual = (variant_launches(rows[n], tail, B, Hq, H, L)[0] for n in ("default", "residual"))
    # the tail block column is gone with the residual in the loop: 2 splits, no third column
    assert len(default["programs"]) == 3 * B * H and len(residual["programs"]) == 2 * B * H
    assert rows["stages4"]["ring_bytes"] == 4 * 4 * 3072 and rows["stages2"]["ring_bytes"] == 2 * 4 * 3072
    assert rows["stages4"]["chunk_ldgsts"] > 0 and rows["default"]["chunk_ldgsts"] == 0


def test_magic_codes_shorten_the_chunk_loop(committed):
    """KIVI_DECODE_FOLD16=2 drops the key codes' fma2 (and their constants) for two MMAs' worth of bias:
    the counted loop is shorter than the 16-bit fold's by more than the 64 fma2 it removes, alone and
    in the best design, and its query copy is priced as shared memory."""
    rows = {r["variant"]: r for r in committed["rows"]}
    for magic, fold in (("magic", "fold16"), ("magic-residual-stages4-blocks4", "fold16-residual-stages4-blocks4")):
        assert rows[fold]["chunk"]["instructions"] - rows[magic]["chunk"]["instructions"] > 64, magic
        assert rows[magic]["query_copy_bytes"] == 2048 and rows[fold]["query_copy_bytes"] == 0
        assert rows[magic]["spill_store_bytes"] == 0
