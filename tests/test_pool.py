"""Sink tokens and OTT outlier tokens (kivi_ops/options/pool.py) against an independent reference.

The reference below re-derives, per sequence and kv head, what attention must see from the
exact keys/values alone (Python lists and sorted(), dense fake quantization, plain softmax):
which tokens are pooled, the quantized keys of each group computed without its pooled rows,
and exact K/V for pooled tokens. The cache ops (CPU reference kernel, eager) and the decomposed
forms (a portable cache: decomposed append, materialized attention; and the fused decode form
compiled CPU decode runs) must agree with it after every append.
"""

import math
import random

import pytest
import torch

from cache_step import CacheStep, check_compiled_matches_eager, check_export_matches_eager, step_inputs
from kivi_ops import KIVICache, KIVIConfig, Step
from kivi_ops.kernels.decomposed.attend import attend_fused
from kivi_ops.layout import REQUIRED_TENSORS, LayerTensors

B, H, HQ, D, S = 2, 2, 4, 16, 72
ATOL = RTOL = 1e-5


# ---------------------------------------------------------------- the independent reference


def fake_quant_rows(x, lo, hi, bits):
    """x quantized with per-column min lo / max hi (fp32 cache: no dtype rounding)."""
    scale = (hi - lo) / (2**bits - 1)
    safe = torch.where(scale == 0, torch.ones_like(scale), scale)
    q = torch.floor((x - lo) / safe + 0.5).clamp(0, 2**bits - 1)
    return q * scale + lo


def reference_view(K, V, L, cfg, n_out):
    """(keys, values, pooled positions) attention sees for one sequence/head holding tokens
    [0, L) with exact K, V [T, D]: KIVI streaming plus the pool, derived step by step. The flush
    policy (docs/cache.md): kivi quantizes keys in R-token windows, [0, L // R * R), and values
    [0, L - R); ott quantizes both in G-token windows up to the last R tokens (rounded down to G)."""
    R, G, sink, spill = cfg.residual_length, cfg.group_size, cfg.sink_tokens, cfg.outlier_spill
    mags = K.abs().sum(-1).tolist()
    outliers, spilled = [], []
    keys = K[:L].clone()
    if cfg.flush_policy == "ott":
        unit, nqk = G, max(L - R, 0) // G * G
        nqv = nqk
    else:
        unit, nqk, nqv = R, L // R * R, max(L - R, 0)
    for w0 in range(0, nqk, unit):
        entrants = []
        if n_out:
            cands = [(mags[p], i, p) for i, p in enumerate(outliers)]
            cands += [(mags[p], n_out + j, p) for j, p in enumerate(range(w0, w0 + unit)) if p >= sink]
            new = [p for _, _, p in sorted(cands)[:n_out]]
            evicted = [p for p in outliers if p not in new]
            if len(evicted) <= spill - len(spilled):
                spilled += evicted
                entrants = [p for p in new if p >= w0]
                outliers = new
        out_of_stats = set(entrants) | set(range(w0, min(w0 + unit, sink)))
        for g0 in range(w0, w0 + unit, G):
            rows = [p for p in range(g0, g0 + G) if p not in out_of_stats]
            if rows:
                lo, hi = K[rows].amin(0), K[rows].amax(0)
                keys[rows] = fake_quant_rows(K[rows], lo, hi, cfg.k_bits)
    values = V[:L].clone()
    gv = min(G, D)
    g = V[:nqv].reshape(nqv, D // gv, gv)  # values: per token, groups of gv channels
    values[:nqv] = fake_quant_rows(g, g.amin(-1, keepdim=True), g.amax(-1, keepdim=True),
                                   cfg.v_bits).reshape(nqv, D)
    pooled = set(range(min(sink, L))) | set(outliers) | set(spilled)
    for p in pooled:
        keys[p], values[p] = K[p], V[p]
    return keys, values, pooled


def reference_attend(query, K, V, lengths, counts, cfg, n_out, scale):
    """Plain softmax attention of query [B, HQ, q, D] over reference_view of every row/head."""
    out = torch.zeros_like(query)
    q_len = query.shape[2]
    for b in range(B):
        L = int(lengths[b])
        c = q_len if counts is None else int(counts[b])
        views = [reference_view(K[b, h], V[b, h], L, cfg, n_out) for h in range(H)]
        for hq in range(HQ):
            keys, values, _ = views[hq // (HQ // H)]
            for i in range(c):
                pos = L - c + i
                p = torch.softmax(query[b, hq, i] @ keys[: pos + 1].T * scale, dim=-1)
                out[b, hq, i] = p @ values[: pos + 1]
    return out


# ---------------------------------------------------------------- driving the cache


def make_keys(T, seed):
    """Keys with an outlier channel and a few low-magnitude tokens (OTT's outlier tokens)."""
    gen = torch.Generator().manual_seed(seed)
    K = torch.randn(B, H, T, D, generator=gen)
    K[..., 3] += 6.0
    low = torch.randperm(T, generator=gen)[: T // 6]
    K[:, :, low] *= 0.05 + 0.2 * torch.rand(B, H, len(low), 1, generator=gen)
    return K, torch.randn(B, H, T, D, generator=gen)


def schedule(seed):
    """Appends: a ragged prefill spanning several key windows, decode steps, a chunk, decode steps."""
    rnd = random.Random(seed)
    return [[rnd.randint(17, 26), rnd.randint(9, 26)]] + [[1, 1]] * 9 + [[7, rnd.randint(0, 7)]] + [[1, 1]] * 12


def run(cfg, portable, seed=0, layer=0, num_layers=1, check_every=True):
    """Append per schedule to a cache (portable: the decomposed forms, else the kivi ops); after
    every append compare decode (and chunk) attention with the independent reference (portable:
    decode also in the fused form, attend_fused). Returns the cache."""
    cache = KIVICache(cfg, num_layers=num_layers, batch_size=B, max_seq_len=S, num_kv_heads=H, head_dim=D,
                      portable=portable)
    n_out = cfg.layer_outlier_tokens(layer)
    T = sum(max(c) for c in schedule(seed))
    K, V = make_keys(T, seed)
    stored = [[], []]  # positions -> source index per row, to rebuild each row's exact tokens
    gen = torch.Generator().manual_seed(seed + 1)
    src = 0
    scale = 1 / math.sqrt(D)
    for step, counts in enumerate(schedule(seed)):
        n = max(counts)
        key, value = K[:, :, src : src + n], V[:, :, src : src + n]
        for b in range(B):
            stored[b] += list(range(src, src + counts[b]))
        src += n
        cnt = torch.tensor(counts)
        cache.layers[layer].append(key, value, Step(counts=cnt))
        rowsK = [K[b][:, stored[b]] for b in range(B)]
        rowsV = [V[b][:, stored[b]] for b in range(B)]
        T_max = max(len(s) for s in stored)
        Kr = torch.zeros(B, H, T_max, D)
        Vr = torch.zeros(B, H, T_max, D)
        for b in range(B):
            Kr[b, :, : len(stored[b])], Vr[b, :, : len(stored[b])] = rowsK[b], rowsV[b]
        if check_every or step == len(schedule(seed)) - 1:
            q = torch.randn(B, HQ, 1, D, generator=gen)
            want = reference_attend(q, Kr, Vr, cache.layers[layer].lengths, None, cfg, n_out, scale)
            torch.testing.assert_close(cache.layers[layer].attend(q), want, atol=ATOL, rtol=RTOL)
            if portable:
                fused = attend_fused(q, cache.layers[layer].tensors(), None, cache.layers[layer].params, scale)
                torch.testing.assert_close(fused, want, atol=ATOL, rtol=RTOL)
            if n > 1:  # the chunk's own queries, causal over the chunk
                q = torch.randn(B, HQ, n, D, generator=gen)
                want = reference_attend(q, Kr, Vr, cache.layers[layer].lengths, cnt, cfg, n_out, scale)
                torch.testing.assert_close(cache.layers[layer].attend(q, Step(counts=cnt)), want, atol=ATOL, rtol=RTOL)
    # The pool holds exactly the reference's pooled positions.
    for b in range(B):
        for h in range(H):
            _, _, pooled = reference_view(Kr[b, h], Vr[b, h], int(cache.layers[layer].lengths[b]), cfg, n_out)
            pool = cache.layers[layer].tensors().pool
            pos = pool[2][b, h] if pool is not None else torch.empty(0)
            assert sorted(p for p in pos.tolist() if p >= 0) == sorted(pooled)
    return cache


SINK = KIVIConfig(2, 2, group_size=4, residual_length=8, sink_tokens=2)
OTT = KIVIConfig(2, 2, group_size=4, residual_length=8, outlier_tokens=2, outlier_spill=3, outlier_skip_layers=0)
BOTH = KIVIConfig(2, 4, group_size=4, residual_length=16, sink_tokens=1, outlier_tokens=3, outlier_spill=4,
                  outlier_skip_layers=0)
# OTT's own flush policy (G-token groups, the last R always exact; R not a multiple of G)
OTT_POLICY = KIVIConfig(2, 2, group_size=4, residual_length=3, outlier_tokens=2, outlier_spill=3,
                        outlier_skip_layers=0, flush_policy="ott")
BOTH_OTT_POLICY = KIVIConfig(2, 4, group_size=8, residual_length=5, sink_tokens=1, outlier_tokens=3, outlier_spill=4,
                             outlier_skip_layers=0, flush_policy="ott")


@pytest.mark.parametrize("cfg", [SINK, OTT, BOTH, OTT_POLICY, BOTH_OTT_POLICY],
                         ids=["sink", "ott", "sink+ott", "ott-policy", "sink+ott-policy"])
@pytest.mark.parametrize("portable", [False, True], ids=["op", "decomposed"])
def test_cache_matches_independent_reference(cfg, portable):
    run(cfg, portable, check_every=not portable)


def test_spill_pool_fills_and_stops_new_outliers():
    cfg = KIVIConfig(2, 2, group_size=4, residual_length=8, outlier_tokens=2, outlier_spill=1, outlier_skip_layers=0)
    cache = run(cfg, False, seed=3, check_every=False)
    pos = cache.layers[0].pool.pos
    assert (pos[..., 2] >= 0).all()  # every spill slot used


def test_reference_and_decomposed_write_identical_buffers():
    caches = [run(BOTH, portable, seed=5, check_every=False) for portable in (False, True)]
    for (name, a), (_, b) in zip(caches[0].named_buffers(), caches[1].named_buffers(), strict=True):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_reference_and_decomposed_agree(dtype):
    K, V = make_keys(45, 4)
    # the reference, and (portable) the decomposed forms
    caches = [KIVICache(BOTH, num_layers=1, batch_size=B, max_seq_len=S, num_kv_heads=H, head_dim=D, dtype=dtype,
                        portable=portable) for portable in (False, True)]
    for cache in caches:
        cache.layers[0].append(K[:, :, :21].to(dtype), V[:, :, :21].to(dtype), Step(counts=torch.tensor([21, 13])))
        for t in range(21, 45):
            cache.layers[0].append(K[:, :, t : t + 1].to(dtype), V[:, :, t : t + 1].to(dtype))
    for (name, a), (_, b) in zip(caches[0].named_buffers(), caches[1].named_buffers(), strict=True):
        assert torch.equal(a, b), name
    q = torch.randn(B, HQ, 1, D).to(dtype)
    want = caches[0].layers[0].attend(q)
    torch.testing.assert_close(caches[1].layers[0].attend(q), want, atol=1e-2, rtol=1e-2)  # materialized
    fused = attend_fused(q, caches[1].layers[0].tensors(), None, caches[1].layers[0].params, 1 / math.sqrt(D))
    torch.testing.assert_close(fused, want, atol=1e-2, rtol=1e-2)


def test_dequantized_shows_pooled_tokens_exact():
    K, V = make_keys(40, 6)
    cache = KIVICache(BOTH, num_layers=1, batch_size=B, max_seq_len=S, num_kv_heads=H, head_dim=D)
    cache.layers[0].append(K, V)
    keys, values = cache.layers[0].dequantized()
    pos = cache.layers[0].pool.pos
    assert (pos[..., 1:] >= 0).any()
    for b, h, i in (pos >= 0).nonzero().tolist():
        t = int(pos[b, h, i])
        assert torch.equal(keys[b, h, t], K[b, h, t]) and torch.equal(values[b, h, t], V[b, h, t])


def test_prefill_at_once_equals_token_by_token():
    K, V = make_keys(40, 7)
    caches = [KIVICache(BOTH, num_layers=1, batch_size=B, max_seq_len=S, num_kv_heads=H, head_dim=D) for _ in range(2)]
    caches[0].layers[0].append(K, V)
    for t in range(40):
        caches[1].layers[0].append(K[:, :, t : t + 1], V[:, :, t : t + 1])
    for (name, a), (_, b) in zip(caches[0].named_buffers(), caches[1].named_buffers(), strict=True):
        if name.endswith((".k_res", ".v_res")):  # slots past the window hold stale tokens either way
            continue
        assert torch.equal(a, b), name


# ---------------------------------------------------------------- options off, layers, memory, errors


def test_options_off_is_plain_kivi():
    plain = KIVIConfig(2, 2, 4, 8)
    cache = KIVICache(plain, num_layers=2, batch_size=B, max_seq_len=S, num_kv_heads=H, head_dim=D)
    # nothing but the nine KIVI buffers per layer
    for layer in cache.layers:
        assert layer.pool is None and layer.sparse is None and layer.levels is None
        assert sorted(n for n, _ in layer.named_buffers()) == sorted(REQUIRED_TENSORS)
    assert len(list(cache.named_buffers())) == 2 * len(REQUIRED_TENSORS)
    assert cache.layers[0].tensors().pool is None
    assert all(t is None for t in cache.layers[0].tensors()[len(REQUIRED_TENSORS):])
    # outliers only from layer outlier_skip_layers on; the first layers run the plain ops, bit for bit
    cfg = KIVIConfig(2, 2, 4, 8, outlier_tokens=3)
    ott = KIVICache(cfg, num_layers=3, batch_size=B, max_seq_len=S, num_kv_heads=H, head_dim=D)
    assert [cfg.layer_outlier_tokens(i) for i in range(3)] == [0, 0, 3]
    assert ott.layers[1].tensors().pool is None and len(ott.layers[2].tensors().pool) == 3
    K, V = make_keys(30, 1)
    q = torch.randn(B, HQ, 1, D)
    for layer in (0, 1):
        ott.layers[layer].append(K, V)
    cache.layers[0].append(K, V)
    for name, a, b in zip(REQUIRED_TENSORS, ott.layers[1].tensors().kivi, cache.layers[0].tensors().kivi, strict=True):
        assert torch.equal(a, b), name
    assert torch.equal(ott.layers[1].attend(q), cache.layers[0].attend(q))


def test_nbytes_counts_the_pool():
    base = KIVICache(KIVIConfig(2, 2, 4, 8), num_layers=3, batch_size=B, max_seq_len=S, num_kv_heads=H, head_dim=D)
    cfg = KIVIConfig(2, 2, 4, 8, sink_tokens=1, outlier_tokens=3, outlier_spill=32)
    both = KIVICache(cfg, num_layers=3, batch_size=B, max_seq_len=S, num_kv_heads=H, head_dim=D)
    P = [1, 1, 36]
    assert [cfg.layer_pool_size(i) for i in range(3)] == P
    assert both.nbytes() - base.nbytes() == sum(B * H * p * (2 * D * 4 + 8) for p in P)


def test_reset_empties_the_pool():
    cache = run(SINK, False, check_every=False)
    cache.reset()
    assert (cache.layers[0].pool.pos == -1).all()


@pytest.mark.parametrize("kwargs, match", [
    (dict(sink_tokens=-1), "sink_tokens"),
    (dict(sink_tokens=1.5), "sink_tokens"),
    (dict(sink_tokens=True), "sink_tokens"),
    (dict(sink_tokens=65), "at most 64"),
    (dict(outlier_tokens=-2), "outlier_tokens"),
    (dict(outlier_tokens=200), "at most residual_length"),
    (dict(outlier_spill=-1), "outlier_spill"),
    (dict(outlier_skip_layers="2"), "outlier_skip_layers"),
])
def test_invalid_options_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        KIVIConfig(2, 2, 32, 128, **kwargs)


def test_outliers_skipping_every_layer_raise():
    with pytest.raises(ValueError, match="would apply to no layer"):
        KIVICache(KIVIConfig(2, 2, 4, 8, outlier_tokens=3, outlier_skip_layers=2), num_layers=2, batch_size=1,
                  max_seq_len=16, num_kv_heads=1, head_dim=16)


def test_pool_ops_opcheck():
    cache = run(BOTH, False, check_every=False)
    layer, params = cache.layers[0].tensors(), cache.layers[0].params
    assert layer.pool is not None and params == (2, 4, 4, 16, 1, 3, 0)
    clone = LayerTensors(*(None if t is None else t.clone() for t in layer))
    k, v = torch.randn(B, H, 3, D), torch.randn(B, H, 3, D)
    torch.library.opcheck(torch.ops.kivi.cache_append.default, (*clone, k, v, torch.tensor([3, 1]), *params))
    torch.library.opcheck(torch.ops.kivi.cache_attend.default,
                          (torch.randn(B, HQ, 2, D), *layer, torch.tensor([2, 1]), *params, 0.25))


# ---------------------------------------------------------------- compile / export with the options on


def make_step(portable=False, **mode):
    cache = KIVICache(BOTH, num_layers=1, batch_size=B, max_seq_len=S, num_kv_heads=H, head_dim=D, portable=portable)
    return CacheStep(cache, *make_keys(31, 2), torch.tensor([31, 20]), **mode)


def test_compile_fullgraph_with_pool_ops():
    # The kivi ops themselves in a compiled graph (what CUDA runs). Row 0 crosses a key flush
    # (32 tokens) at the first step.
    check_compiled_matches_eager(make_step, step_inputs(3, B=B, H=H, HQ=HQ, D=D), through_op=True, atol=0, rtol=0)


@pytest.mark.slow  # Inductor compile, 15-35 s on 2 cores with a cold cache
def test_compile_fullgraph_decomposed_with_pool():
    # What compiled CPU decode runs: dispatch.py traces the decomposed forms (append_decomposed,
    # attend_fused) inline.
    check_compiled_matches_eager(make_step, step_inputs(3, B=B, H=H, HQ=HQ, D=D), atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("portable", [False, True], ids=["op", "portable"])
def test_export_with_pool(portable):
    check_export_matches_eager(make_step, portable, step_inputs(2, B=B, H=H, HQ=HQ, D=D), atol=ATOL, rtol=RTOL)


# ---------------------------------------------------------------- command line


@pytest.mark.parametrize("argv, message", [
    (["generate", "--prompt", "x", "--sink-tokens", "-1"], "--sink-tokens must be a non-negative int"),
    (["generate", "--prompt", "x", "--outlier-tokens", "129"], "--outlier-tokens must be at most --residual-length=128"),
    (["generate", "--prompt", "x", "--sink-tokens", "x"], "invalid int value"),
    (["generate", "--prompt", "x", "--method", "fp", "--sink-tokens", "1"], "options of the KIVI cache"),
    (["eval", "ppl", "--corpus", "pydoc", "--method", "fake", "--outlier-tokens", "3"], "options of the KIVI cache"),
])
def test_cli_rejects_invalid_options(argv, message, capsys):
    from kivi_cli.main import main

    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2 and message in capsys.readouterr().err
