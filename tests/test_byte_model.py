"""The byte model (lab/byte_model.py): loads counted in Triton's interpreter."""

import pytest

from lab.byte_model import measure, must_read_append, must_read_attend


def test_must_read_counts_the_cache_state():
    # 300 tokens, R=128: keys 256 quantized (8 groups) + 44 exact; values 172 quantized + 128 exact.
    assert must_read_attend(300, 1, 1, 1, 64, 2, 32, 128) == (
        256 * 16 + 8 * 64 * 4 + 44 * 128) + (172 * 16 + 172 * 2 * 4 + 128 * 128) + 128 + 8
    assert must_read_append(1, 1, 64, 128, flush=False) == 3 * 128 + 8
    assert must_read_append(1, 1, 64, 128, flush=True) == 3 * 128 + 127 * 128 + 8


@pytest.mark.slow  # Triton builds of the decode kernels (no GPU needed), about 15 s
def test_decode_kernels_read_what_they_must():
    rows = measure(tokens=256)
    by = {}
    for r in rows:
        by.setdefault((r["q_heads"], r["bits"], r["step"]), {})[r["kernel"]] = r
    for (q_heads, bits, step), kernels in by.items():
        if step.startswith("append"):
            # One launch, which reads the new tokens, the leaving value and (on a flush step) the
            # key window, plus each program's lengths entry (8 bytes per kv head): nothing else.
            (append,) = kernels.values()
            assert append["kernel"] == "_append_decode_kernel"
            assert append["distinct_bytes"] == append["must_read_bytes"]
            assert append["loaded_bytes"] - append["must_read_bytes"] == 8 * (append["kv_heads"] - 1)
        else:
            # Every byte of the state is read (a skipped tile would show as < 1); re-reads are
            # allowed (GQA query heads share their kv head's codes), new addresses beyond the
            # state hardly: observed, the scale and zero rows of one (2-bit) or two (4-bit) key
            # groups past the quantized ones per head (fp16, D channels each; < 0.5% at 1K).
            decode = kernels["_attend_decode_kernel"]
            extra_group = 2 * decode["kv_heads"] * 2 * decode["head_dim"] * 2
            assert decode["must_read_bytes"] <= decode["distinct_bytes"] <= decode["must_read_bytes"] + extra_group
