"""3-bit keys and values (issue 28): 8 codes per 3 bytes (packing.py), uniform and nuq3, with
every option, through every implementation: the Triton attention kernels and appends (under the
interpreter without CUDA) against the reference, the compiled and exported cache against eager
generation, and the CLI. The packing itself and the decomposed forms are tested beside the other
widths (test_quantize.py, test_decomposed.py, test_triton_kernels.py)."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from kivi_ops import KIVIConfig, quantize  # noqa: E402
from kivi_ops.options.extras import Extras  # noqa: E402
from kivi_ops.kernels.reference import attend_reference  # noqa: E402
from kivi_ops.layout import QuantParams  # noqa: E402
from test_triton_kernels import (ATTEND, _cpu, _dev, _kvq_extras, _kvq_tolerance,  # noqa: E402
                                 check_append_with_options, fill_pool_cache, fill_reference_cache, kernels, layer,
                                 make_cache, sparse_store)


def test_three_bits_sit_between_two_and_four():
    """Mean dequantization error of Gaussian data: 3 bits strictly between 2 and 4 (each extra bit
    about halves it), and 3/8 of a byte per code."""
    x = torch.randn(4, 256, 64, generator=torch.Generator().manual_seed(0))
    err = {}
    for bits in (2, 3, 4):
        q = quantize(x, bits, 32, "channel")
        assert q.codes.shape[-1] == 64 * bits // 8
        err[bits] = (q.dequantize() - x).abs().mean().item()
    assert err[2] > 1.6 * err[3] and err[3] > 1.6 * err[4], err


# ---------------------------------------------------------------- Triton kernels vs the reference

# Every option alone, 3-bit keys and values (k3/v3, and mixed with 2 or 4 bits), G = 8 (a 3-bit
# value group holds whole 8-code words), R = 16: several key windows, flushes and splits.
OPTIONS = ("plain", "nuq", "rope", "sparse", "pool")
CASES = [("plain", 3, 3, torch.float32), ("plain", 3, 2, torch.float16), ("plain", 4, 3, torch.bfloat16),
         ("nuq", 3, 3, torch.float16), ("rope", 3, 3, torch.bfloat16), ("sparse", 3, 3, torch.float16),
         ("pool", 3, 3, torch.float32), ("nuq+rope+sparse", 3, 3, torch.float16)]


def _option_cache(option, k_bits, v_bits, dtype, B, H, S, D, R, G, lengths):
    extras = _kvq_extras("nuq" in option, 1.0 if "rope" in option else None, D, k_bits, v_bits)
    if "sparse" in option:
        extras = extras._replace(**sparse_store(B, H, S, D, R, 1, 2, dtype))
    if option == "pool":
        cache, pool = fill_pool_cache(B, H, S, D, R, G, k_bits, v_bits, dtype, [(lengths[0], lengths), (1, None)],
                                      1, 2, 2)
        return cache, pool, extras, QuantParams(k_bits, v_bits, G, R, 1, 2)
    cache = fill_reference_cache(B, H, S, D, R, G, k_bits, v_bits, dtype, lengths, extras=extras)
    return cache, None, extras, QuantParams(k_bits, v_bits, G, R)


@pytest.mark.parametrize("q_len", (1, 3), ids=("decode", "causal"))
@pytest.mark.parametrize("option,k_bits,v_bits,dtype", [pytest.param(*c, id=f"{c[0]}-k{c[1]}v{c[2]}-{str(c[3])[6:]}")
                                                       for c in CASES])
def test_attention_kernels_match_reference(option, k_bits, v_bits, dtype, q_len):
    """Both attention kernels (the decode kernel for q_len 1, the split kernel always) against the
    reference, GQA 4/2, head_dim 64. Tolerances as in test_triton_kernels.py: fp32 differs in
    summation order only (1e-5); fp16/bf16 round the dequantized keys/values and probabilities
    to the dtype (4 eps)."""
    B, H, Hq, S, D, R, G = 2, 2, 4, 64, 64, 16, 8
    cache, pool, extras, params = _option_cache(option, k_bits, v_bits, dtype, B, H, S, D, R, G, [41, 22])
    query = torch.randn(B, Hq, q_len, D, generator=torch.Generator().manual_seed(9)).to(dtype)
    counts = None if q_len == 1 else torch.tensor([3, 2])
    ref = attend_reference(query, layer(cache, pool, extras), counts, params, D**-0.5)
    dev = layer([_dev(t) for t in cache], None if pool is None else tuple(map(_dev, pool)), Extras(*map(_dev, extras)))
    for kernel in kernels(q_len):
        out = _cpu(ATTEND[kernel](_dev(query), dev, _dev(counts), params, D**-0.5, num_splits=2, block_n=16))
        tol = _kvq_tolerance(dtype)
        torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol, msg=lambda m: f"{kernel}: {m}")


@pytest.mark.parametrize("option,D,dtype", [  # the parts alone in `make test-slow` (10 s a case)
    pytest.param("nuq", 64, torch.float16, marks=pytest.mark.slow),
    pytest.param("sparse", 64, torch.bfloat16, marks=pytest.mark.slow),
    ("pool", 128, torch.float32), ("pool+sparse+nuq", 64, torch.float16)])
def test_append_kernels_match_reference(option, D, dtype):
    """Both append paths (a ragged prefill chunk: the multi-launch kernels; decode steps across
    key flushes: the one-launch kernel) write the reference's bytes at 3 bits, with each option."""
    ref = check_append_with_options(option, D, dtype, k_bits=3, v_bits=3, R=16, G=8, prompt=[21, 13], steps=12)
    assert ref[-1].tolist() == [33, 19]
    assert (ref[0] != 0).any() and (ref[4] != 0).any(), "nothing was quantized: the case tests nothing"


def test_config_and_cache_at_three_bits():
    """A 3-bit layer's code buffers hold exactly 3/8 byte per element, as whole registered buffers."""
    from kivi_ops import KIVICache

    cache = KIVICache(KIVIConfig(3, 3, 32, 128), num_layers=2, batch_size=2, max_seq_len=256, num_kv_heads=3,
                      head_dim=64)
    lay = cache.layers[0]
    assert lay.k_codes.shape == (2, 3, 256, 24) and lay.v_codes.shape == (2, 3, 256, 24)
    names = dict(lay.named_buffers(recurse=False))
    assert names["k_codes"] is lay.k_codes and lay.k_codes.is_contiguous()
    with pytest.raises(ValueError, match="k_bits=3 packs 8 codes per word"):
        KIVIConfig(3, 2, 4, 128)


# ---------------------------------------------------------------- a 3-bit cache in a model: compiled, exported

# A tiny random Llama (head_dim 16, 2 layers) whose prompt + 20 new tokens cross four key windows
# (G = R = 8): eager decode runs the compiled-per-op CPU forms, compile traces the decomposed forms
# inline, pt2 / AOTInductor keep the kivi ops (their CPU kernel: the reference), ONNX / ExecuTorch
# run the portable core-ATen forms. Greedy tokens must be the eager generation's.
PROMPT_IDS = [1, 5, 9, 17, 33, 2, 41]
NEW_TOKENS = 20
LEVELS3 = ((0.0, 0.8, 2.1, 3.0, 3.9, 5.2, 6.1, 7.0),)


def _tiny_config(options: str) -> KIVIConfig:
    if options == "plain":
        return KIVIConfig(3, 3, group_size=8, residual_length=8)
    if options == "k3v2":
        return KIVIConfig(3, 2, group_size=8, residual_length=8)
    # nuq3 + pre-RoPE + 10% dense-and-sparse + a sink + OTT outliers in both layers
    return KIVIConfig(3, 3, group_size=8, residual_length=8, pre_rope=True, sparse_outliers=0.1, sink_tokens=1,
                      outlier_tokens=2, outlier_skip_layers=0, key_levels=LEVELS3 * 2, value_levels=LEVELS3 * 2)


@pytest.fixture(scope="module")
def tiny():
    from transformers import AutoTokenizer

    from kivi_models import patch_model
    from kivi_models.loading import default_model_dir
    from tiny_models import tiny_llama

    model = patch_model(tiny_llama(hidden_size=64, intermediate_size=128))
    tokenizer = AutoTokenizer.from_pretrained(default_model_dir(), local_files_only=True)
    return model, tokenizer


def _eager_tokens(model, config, step_fn=None):
    from kivi_models.generate import decode_step, generate, make_cache

    cache = make_cache(model, method="kivi", batch_size=1, max_seq_len=32, kivi_config=config)
    with torch.no_grad():
        result = generate(model, [PROMPT_IDS], max_new_tokens=NEW_TOKENS, cache=cache, step_fn=step_fn or decode_step)
    return result.tokens[0]


# make test: the plain cache (the fused decode form) compiled, and a pt2 and an ONNX export with
# every option; the rest (about a minute each) in make test-slow.
# Compiled 3-bit generation in `make test-slow` (a cold Inductor build each); the fast suite traces the
# same decomposed forms in the pt2 exports below.
@pytest.mark.slow
@pytest.mark.parametrize("options", ["every-option"])
def test_compiled_generation_equals_eager(tiny, options):
    from kivi_models.generate import compile_decode_step

    model, _ = tiny
    config = _tiny_config(options)
    assert _eager_tokens(model, config, compile_decode_step(torch.device("cpu"))) == _eager_tokens(model, config)


@pytest.mark.parametrize("fmt,options", [
    ("pt2", "every-option"),
    # plain and k3v2 are subsets of every-option's path (6-9 s each of `make test`): make test-slow, as are
    # ONNX, AOTInductor and ExecuTorch with every option (40 s to 2.5 minutes each)
    *(pytest.param("pt2", o, marks=pytest.mark.slow) for o in ("plain", "k3v2")),
    *(pytest.param(f, "every-option", marks=pytest.mark.slow) for f in ("onnx", "aoti", "pte"))])
def test_export_equals_generate(tiny, fmt, options, tmp_path):
    from kivi_export.exporter import export_decoder
    from kivi_export.runtime import load_exported
    from kivi_models.generate import generation_loop

    if fmt == "pte":
        pytest.importorskip("executorch.runtime")
    model, tokenizer = tiny
    config = _tiny_config(options)
    want = _eager_tokens(model, config)
    export_decoder(model, tokenizer, tmp_path / fmt, fmt=fmt, model_name="tiny", kivi_config=config, batch_size=1,
                   max_seq_len=32)
    meta, _, step = load_exported(tmp_path / fmt)
    assert (meta.config_summary()["kivi"]["k_bits"], meta.config_summary()["kivi"]["v_bits"]) == (config.k_bits,
                                                                                                  config.v_bits)
    result = generation_loop(
        lambda input_ids, counts: step(input_ids, torch.zeros_like(counts), counts),
        lambda tokens, positions: step(tokens[:, None], positions, torch.ones_like(positions)),
        [PROMPT_IDS], max_new_tokens=NEW_TOKENS, device="cpu")
    assert result.tokens[0] == want and len(want) == NEW_TOKENS
