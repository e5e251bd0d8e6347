"""KVQuant's options in the KIVI cache (kivi_ops/options/extras.py): nuq levels, dense-and-sparse outliers
and pre-RoPE keys, against an independent reference of their math.

The reference re-derives what attention must see from the exact (pre-RoPE) keys/values alone:
each flushed R-token key window fake-quantized per channel by nuq.fake_quantize_nuq (which picks
its own outliers per channel), each quantized value token per token, the rest exact; keys then
rotated with RoPE written as complex multiplication (independent of rope.py's rotate-half form);
attention a plain dense softmax.
"""

import pytest
import torch

from cache_step import CacheStep, check_compiled_matches_eager, check_export_matches_eager, step_inputs
from kivi_ops import KIVICache, KIVIConfig, Step
from kivi_ops.layout import REQUIRED_TENSORS, LayerTensors
from kivi_ops.calibration.nuq import fake_quantize_nuq, uniform_levels

B, H, HQ, D, S, G, R = 2, 2, 4, 16, 72, 8, 16
INV_FREQ = 1.0 / (10000 ** (torch.arange(0, D, 2, dtype=torch.float32) / D))
K_LEVELS = (0.15, 1.05, 1.95, 2.9)  # 2-bit nuq levels (sorted, inside [0, 3])
V_LEVELS = tuple(float(x) for x in torch.linspace(0, 15, 16) ** 1.1 / 15**0.1)  # 4-bit, skewed
# fp32 throughout: dequantized values agree up to the rounding of a handful of fp32 operations.
ATOL = RTOL = 1e-5

NUQ = dict(key_levels=(K_LEVELS,), value_levels=(V_LEVELS,))
CONFIGS = {
    "nuq": KIVIConfig(2, 4, G, R, **NUQ),
    "sparse": KIVIConfig(2, 4, G, R, sparse_outliers=0.1),
    "pre_rope": KIVIConfig(2, 4, G, R, pre_rope=True),
    "all": KIVIConfig(2, 4, G, R, pre_rope=True, sparse_outliers=0.1, **NUQ),
}
# Appends: a right-padded prefill, then a chunk and single tokens (crossing key flushes at 16, 32, 48).
SCHEDULE = [(23, [23, 17]), (5, [5, 3]), *[(1, None)] * 26]


def make_cache(cfg, *, layers=1, dtype=torch.float32, portable=False):
    rope = dict(rope_inv_freq=INV_FREQ) if cfg.pre_rope else {}
    return KIVICache(cfg, num_layers=layers, batch_size=B, max_seq_len=S, num_kv_heads=H, head_dim=D,
                     dtype=dtype, portable=portable, **rope)


def make_tokens(seed, n):
    gen = torch.Generator().manual_seed(seed)
    keys = torch.randn(B, H, n, D, generator=gen)
    keys[..., 3] *= 6  # an outlier channel, as real keys have
    return keys, torch.randn(B, H, n, D, generator=gen) * torch.linspace(0.5, 3, D)


# ---------------------------------------------------------------- the independent reference


def rotate(x, positions):
    """RoPE of x [T, D] at positions [T]: channel pairs (i, i + D/2) as complex numbers times e^(i t f_i)."""
    half = x.shape[-1] // 2
    z = torch.complex(x[:, :half].double(), x[:, half:].double())
    z = z * torch.polar(torch.ones(len(positions), half, dtype=torch.float64), positions[:, None].double() * INV_FREQ.double())
    return torch.cat([z.real, z.imag], dim=-1).float()


def reference_view(K, V, L, cfg):
    """(keys, values) attention sees for one sequence/head holding tokens [0, L), exact K, V [T, D]."""
    k_levels = torch.tensor(cfg.key_levels[0]) if cfg.has_nuq else uniform_levels(cfg.k_bits)
    v_levels = torch.tensor(cfg.value_levels[0]) if cfg.has_nuq else uniform_levels(cfg.v_bits)
    keys, values = K[:L].clone(), V[:L].clone()
    for w0 in range(0, L // R * R, R):
        keys[w0:w0 + R] = fake_quantize_nuq(K[w0:w0 + R], cfg.k_bits, G, "channel", k_levels, cfg.sparse_outliers)
    for t in range(max(L - R, 0)):
        values[t:t + 1] = fake_quantize_nuq(V[t:t + 1], cfg.v_bits, G, "token", v_levels, cfg.sparse_outliers)
    if cfg.pre_rope:
        keys = rotate(keys, torch.arange(L))
    return keys, values


def reference_attention(query, K, V, lengths, counts, cfg, scale):
    out = torch.zeros_like(query)
    for b in range(B):
        L, c = int(lengths[b]), int(counts[b])
        for h in range(HQ):
            keys, values = reference_view(K[b, h * H // HQ], V[b, h * H // HQ], L, cfg)
            for i in range(c):
                p = torch.softmax(query[b, h, i] @ keys[: L - c + i + 1].T * scale, dim=-1)
                out[b, h, i] = p @ values[: L - c + i + 1]
    return out


def run(cfg, portable, *, check=True):
    """portable: the decomposed forms (append_decomposed, attend_materialized, which every
    KVQuant option takes), else the kivi ops."""
    cache = make_cache(cfg, portable=portable)
    K, V = make_tokens(0, S)
    gen = torch.Generator().manual_seed(1)
    L = torch.zeros(B, dtype=torch.long)
    for step, (n, counts) in enumerate(SCHEDULE):
        c = torch.full((B,), n) if counts is None else torch.tensor(counts)
        key = torch.stack([K[b, :, int(L[b]):int(L[b]) + n] for b in range(B)])
        value = torch.stack([V[b, :, int(L[b]):int(L[b]) + n] for b in range(B)])
        cache.layers[0].append(key, value, Step(counts=None if counts is None else c))
        L += c
        if check and (step < 3 or step % 7 == 0 or step == len(SCHEDULE) - 1):
            query = torch.randn(B, HQ, n, D, generator=gen)
            want = reference_attention(query, K, V, L, c, cfg, 0.3)
            got = cache.layers[0].attend(query, Step(counts=None if counts is None else c), 0.3)
            torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)
            keys, values = cache.layers[0].dequantized()
            for b in range(B):
                for h in range(H):
                    rk, rv = reference_view(K[b, h], V[b, h], int(L[b]), cfg)
                    torch.testing.assert_close(keys[b, h, : int(L[b])], rk, atol=ATOL, rtol=RTOL)
                    torch.testing.assert_close(values[b, h, : int(L[b])], rv, atol=ATOL, rtol=RTOL)
    return cache


@pytest.mark.parametrize("portable", [False, True], ids=["op", "decomposed"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_cache_matches_independent_reference(name, portable):
    run(CONFIGS[name], portable)


def test_op_and_decomposed_write_identical_buffers_with_every_option():
    cfg = KIVIConfig(2, 4, G, R, pre_rope=True, sparse_outliers=0.1, sink_tokens=1, outlier_tokens=2,
                     outlier_skip_layers=0, **NUQ)
    a, b = run(cfg, False, check=False), run(cfg, True, check=False)
    for (name, x), (_, y) in zip(a.named_buffers(), b.named_buffers(), strict=True):
        assert torch.equal(x, y), name
    query = torch.randn(B, HQ, 1, D)
    torch.testing.assert_close(a.layers[0].attend(query), b.layers[0].attend(query), atol=ATOL, rtol=RTOL)


def test_uniform_levels_store_exactly_what_kivi_stores():
    uniform = KIVIConfig(2, 4, G, R, key_levels=(tuple(uniform_levels(2).tolist()),),
                         value_levels=(tuple(uniform_levels(4).tolist()),))
    a, b = run(KIVIConfig(2, 4, G, R), False, check=False), run(uniform, False, check=False)
    for name, x, y in zip(REQUIRED_TENSORS, a.layers[0].tensors().kivi, b.layers[0].tensors().kivi, strict=True):
        assert torch.equal(x, y), name
    query = torch.randn(B, HQ, 1, D)
    torch.testing.assert_close(a.layers[0].attend(query), b.layers[0].attend(query), atol=ATOL, rtol=RTOL)


def test_sparse_outliers_leave_the_group_range():
    # One huge entry per value token: with dense-and-sparse it is exact and the rest of its group
    # keeps a fine scale; without, the group's scale is set by the outlier.
    cfg = KIVIConfig(4, 4, G, R, sparse_outliers=0.01)
    err = {}
    for name, c in (("sparse", cfg), ("plain", KIVIConfig(4, 4, G, R))):
        cache = make_cache(c)
        K, V = make_tokens(3, 40)
        V[..., 5] = 100.0
        cache.layers[0].append(K, V)
        _, values = cache.layers[0].dequantized()
        if name == "sparse":
            assert torch.equal(values[:, :, :24, 5], V[:, :, :24, 5])
        err[name] = (values[:, :, :24] - V[:, :, :24]).abs().mean()
    assert err["sparse"] < err["plain"] / 10


def test_pre_rope_keys_are_stored_unrotated():
    cache = make_cache(CONFIGS["pre_rope"])
    K, V = make_tokens(4, 10)
    cache.layers[0].append(K, V)
    assert torch.equal(cache.layers[0].k_res[:, :, :10], K)  # residual: the pre-RoPE keys as given


def test_nbytes_counts_the_sparse_store_and_constants():
    cfg = CONFIGS["all"]
    nk, nv = cfg.sparse_counts(D)
    assert (nk, nv) == (2, 2)  # round(0.1 * 16) for both
    plain = make_cache(KIVIConfig(2, 4, G, R))
    full = make_cache(cfg)
    sparse_bytes = B * H * (S // R * nk * D + S * nv) * (4 + 2)  # fp32 value + int16 index
    constants = (4 + 16) * 4 + D // 2 * 4  # nuq levels + RoPE frequencies, fp32
    assert full.nbytes() - plain.nbytes() == sparse_bytes + constants


def test_reset_empties_the_sparse_store_and_keeps_constants():
    cache = run(CONFIGS["all"], False, check=False)
    layer = cache.layers[0]
    levels, freq = layer.levels.k.clone(), layer.rope_inv_freq.clone()
    cache.reset()
    assert (layer.sparse.k_idx == -1).all() and (layer.sparse.v_idx == -1).all()
    assert not layer.sparse.k.any() and int(layer.lengths.sum()) == 0
    assert torch.equal(layer.levels.k, levels) and torch.equal(layer.rope_inv_freq, freq)


@pytest.mark.parametrize("kwargs, match", [
    (dict(sparse_outliers=0.5), "sparse_outliers must be a fraction in"),
    (dict(sparse_outliers=True), "sparse_outliers must be a fraction in"),
    (dict(pre_rope=1), "pre_rope must be a bool"),
    (dict(key_levels=((0.0, 1.0, 2.0),), value_levels=((0.0, 1.0, 2.0, 3.0),)), r"key_levels\[0\] must be 4 finite"),
    (dict(key_levels=((0.0, 2.0, 1.0, 3.0),), value_levels=((0.0, 1.0, 2.0, 3.0),)), "ascending"),
    (dict(key_levels=((0.0, 1.0, 2.0, 3.0),)), "given together"),
    (dict(key_levels=[(0.0, 1.0, 2.0, 3.0)], value_levels=[(0.0, 1.0, 2.0, 3.0)]), "must be a tuple"),
])
def test_invalid_config_raises(kwargs, match):
    with pytest.raises(ValueError, match=match):
        KIVIConfig(2, 2, **kwargs)


def test_cache_checks_levels_per_layer_and_rope_frequencies():
    with pytest.raises(ValueError, match="one entry per layer"):
        make_cache(CONFIGS["nuq"], layers=2)
    with pytest.raises(ValueError, match="pre_rope=True needs rope_inv_freq"):
        KIVICache(CONFIGS["pre_rope"], num_layers=1, batch_size=1, max_seq_len=8, num_kv_heads=1, head_dim=D)
    with pytest.raises(ValueError, match="only used with pre_rope"):
        KIVICache(KIVIConfig(), num_layers=1, batch_size=1, max_seq_len=8, num_kv_heads=1, head_dim=D,
                  rope_inv_freq=INV_FREQ)


def clone_layer(layer):
    return LayerTensors(*(None if t is None else t.clone() for t in layer))


def opcheck_cache_ops(cache):
    """opcheck of both ops on layer 0 of a filled cache (a chunk append, a ragged 2-token attend)."""
    layer, params = cache.layers[0].tensors(), cache.layers[0].params
    k, v = torch.randn(B, H, 3, D), torch.randn(B, H, 3, D)
    torch.library.opcheck(torch.ops.kivi.cache_append.default,
                          (*clone_layer(layer), k, v, torch.tensor([3, 1]), *params))
    torch.library.opcheck(torch.ops.kivi.cache_attend.default,
                          (torch.randn(B, HQ, 2, D), *layer, torch.tensor([2, 1]), *params, 0.25))


def test_ops_check_extras_and_opcheck():
    cache = run(CONFIGS["all"], False, check=False)
    layer, params = cache.layers[0].tensors(), cache.layers[0].params
    assert params[:4] == (2, 4, G, R)
    ex = layer.extras
    assert ex.k_levels is not None and ex.sparse and ex.rope_inv_freq is not None
    opcheck_cache_ops(cache)
    with pytest.raises(ValueError, match=r"k_levels must be float32 \[4\]"):
        torch.ops.kivi.cache_attend(torch.randn(B, HQ, 1, D), *layer._replace(k_levels=ex.v_levels), None, *params,
                                    0.25)
    with pytest.raises(ValueError, match="rope_inv_freq must be float32"):
        torch.ops.kivi.cache_attend(torch.randn(B, HQ, 1, D), *layer._replace(rope_inv_freq=INV_FREQ[:3]), None,
                                    *params, 0.25)


def test_opcheck_with_every_option():
    # KVQuant's options and the sink/OTT pool on at once.
    cfg = KIVIConfig(2, 4, G, R, pre_rope=True, sparse_outliers=0.1, sink_tokens=1, outlier_tokens=2,
                     outlier_skip_layers=0, **NUQ)
    cache = run(cfg, False, check=False)
    layer = cache.layers[0].tensors()
    assert layer.pool is not None and all(t is not None for t in layer)
    opcheck_cache_ops(cache)


# ---------------------------------------------------------------- compile / export with the options on


def make_step(portable=False, **mode):
    return CacheStep(make_cache(CONFIGS["all"], portable=portable), *make_tokens(5, 31), torch.tensor([31, 20]), **mode)


def test_compile_fullgraph_with_every_option():
    # The kivi ops themselves in a compiled graph (what CUDA runs). Row 0 crosses a key flush
    # (32 tokens) at the second step.
    check_compiled_matches_eager(make_step, step_inputs(3, B=B, H=H, HQ=HQ, D=D), through_op=True, atol=0, rtol=0)


@pytest.mark.slow  # Inductor compile, about 30 s on 2 cores with a cold cache
def test_compile_fullgraph_decomposed_with_every_option():
    # What compiled CPU decode runs: the decomposed forms (attend_materialized with KVQuant's options).
    check_compiled_matches_eager(make_step, step_inputs(3, B=B, H=H, HQ=HQ, D=D), atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("portable", [False, True], ids=["op", "portable"])
def test_export_with_every_option(portable):
    check_export_matches_eager(make_step, portable, step_inputs(2, B=B, H=H, HQ=HQ, D=D), atol=ATOL, rtol=RTOL)


# ---------------------------------------------------------------- the model


def test_pre_rope_cache_rotates_like_the_model():
    """Every token still exact (sequence shorter than R, sink pooled): a pre-RoPE cache must give
    the logits of an unquantized cache, so the op's rotation (of residual and pooled keys) is
    the model's own RoPE."""
    from kivi_models import make_cache as make_model_cache, patch_model
    from kivi_models.generate import decode_step, prefill
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         rope_theta=500.0)
    model = patch_model(LlamaForCausalLM(config).eval())
    ids = torch.randint(0, 64, (1, 9))
    logits = {}
    for name, method, cfg in (("fp", "fp", None),
                              ("pre_rope", "kivi", KIVIConfig(2, 2, 32, 128, pre_rope=True, sink_tokens=1))):
        cache = make_model_cache(model, method=method, batch_size=1, max_seq_len=20, kivi_config=cfg)
        with torch.no_grad():
            out = [prefill(model, cache, ids, torch.tensor([9]))]
            for step in range(4):
                out.append(decode_step(model, cache, out[-1].argmax(-1), torch.tensor([9 + step])))
        logits[name] = torch.stack(out)
    torch.testing.assert_close(logits["pre_rope"], logits["fp"], atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------- command line


@pytest.mark.parametrize("argv, message", [
    (["generate", "--prompt", "x", "--sparse-outliers", "0.7"], "expected a fraction in [0, 0.5)"),
    (["generate", "--prompt", "x", "--method", "fp", "--pre-rope"], "options of the KIVI cache"),
    (["generate", "--prompt", "x", "--nuq", "/nonexistent.json"], "cannot read a calibration file"),
    (["generate", "--prompt", "x", "--nuq", "benchmarks/results/nuq_levels_smollm2.json", "--pre-rope"],
     "calibrated with --pre-rope False"),
])
def test_cli_rejects_invalid_options(argv, message, capsys):
    from kivi_cli.main import main

    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2 and message in capsys.readouterr().err
