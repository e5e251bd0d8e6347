"""The ott flush policy (KIVIConfig.flush_policy="ott", kivi_ops/options/schedule.py, docs/cache.md):
keys and values quantized G tokens at a time, the R most recent tokens always exact, R and G
independent. Checked step by step against a token-by-token reference written from the OTT paper,
and every implementation (reference op, decomposed append, fused and materialized attention,
compiled, exported) against each other. The pool under this policy: tests/test_pool.py."""

import math

import pytest
import torch

from cache_step import CacheStep, check_compiled_matches_eager, check_export_matches_eager, step_inputs
from kivi_ops import KIVICache, KIVIConfig, Step, fake_quantize
from kivi_ops.kernels.decomposed.attend import attend_fused, attend_materialized
from kivi_ops.kernels.reference import attend_reference
from kivi_ops.options.schedule import OTT, quantized_counts
from test_decomposed import ATOL, NAMES, RTOL, run_pair


def ott(k_bits=2, v_bits=2, G=8, R=5, **kw):
    return KIVIConfig(k_bits, v_bits, G, R, flush_policy="ott", **kw)


class OTTPolicyReference:
    """OTT's schedule (its Section 3.2 and 4.1), token by token, independent of the cache's ring
    bookkeeping: exact tokens are the "group tokens" (a group that is not full yet) plus the R
    "recent tokens"; once R + G tokens are exact, the oldest G are quantized, keys per channel
    (one group of G tokens) and values per token."""

    def __init__(self, cfg):
        self.cfg, self.keys, self.values, self.quantized, self.exact = cfg, [], [], 0, []

    def push(self, k, v):  # k, v: [H, D]
        c = self.cfg
        self.exact.append(k)
        self.keys.append(k)
        self.values.append(v)
        if len(self.keys) - self.quantized == c.residual_length + c.group_size:
            q0, q1 = self.quantized, self.quantized + c.group_size
            block = fake_quantize(torch.stack(self.keys[q0:q1], 1), c.k_bits, c.group_size, "channel")
            self.keys[q0:q1] = list(block.unbind(1))
            block = fake_quantize(torch.stack(self.values[q0:q1], 1), c.v_bits, c.group_size, "token")
            self.values[q0:q1] = list(block.unbind(1))
            self.quantized = q1

    def state(self):
        return torch.stack(self.keys, dim=1), torch.stack(self.values, dim=1)


@pytest.mark.parametrize("G, R", [(8, 5), (8, 16), (4, 1), (16, 3)], ids=lambda x: str(x))
def test_streaming_token_by_token_matches_ott_schedule(G, R):
    cfg = ott(2, 4, G, R)
    B, H, D, steps = 2, 3, 32, 90
    cache = KIVICache(cfg, num_layers=1, batch_size=B, max_seq_len=steps, num_kv_heads=H, head_dim=D)
    layer = cache.layers[0]
    refs = [OTTPolicyReference(cfg) for _ in range(B)]
    torch.manual_seed(0)
    for step in range(steps):
        k, v = torch.randn(B, H, 1, D), torch.randn(B, H, 1, D)
        counts = torch.tensor([1, int(step % 4 != 0)])  # row 1 skips every fourth step
        layer.append(k, v, Step(counts=counts))
        for b in range(B):
            if counts[b]:
                refs[b].push(k[b, :, 0], v[b, :, 0])
        keys, values = layer.dequantized()
        for b in range(B):
            if not refs[b].keys:
                assert int(layer.lengths[b]) == 0
                continue
            rk, rv = refs[b].state()
            L = rk.shape[1]
            assert int(layer.lengths[b]) == L
            assert torch.equal(keys[b, :, :L], rk) and torch.equal(values[b, :, :L], rv), (step, b)
            # what is full precision: tokens [q, L), R .. R + G - 1 of them once L >= R
            q = refs[b].quantized
            assert q == max(L - R, 0) // G * G
            assert (L - q == L) if L < R else (R <= L - q < R + G)
            exact = torch.stack(refs[b].exact, 1)
            assert torch.equal(keys[b, :, q:L], exact[:, q:L])
            assert not (keys[b, :, :q] == exact[:, :q]).all(-1).any()  # 2-bit: no quantized key is exact
    assert refs[0].quantized == (steps - R) // G * G > 0


@pytest.mark.parametrize("chunks", [[100], [37, 1, 50, 12], [16, 16, 16, 52], [3, 4, 5, 88]])
def test_prefill_and_chunks_follow_the_ott_schedule(chunks):
    G, R = 8, 13  # R not a multiple of G
    cfg = ott(4, 2, G, R)
    total = sum(chunks)
    torch.manual_seed(1)
    k, v = torch.randn(1, 2, total, 64), torch.randn(1, 2, total, 64)
    cache = KIVICache(cfg, num_layers=1, batch_size=1, max_seq_len=128, num_kv_heads=2, head_dim=64)
    start = 0
    for n in chunks:
        cache.layers[0].append(k[:, :, start:start + n], v[:, :, start:start + n])
        start += n
    keys, values = cache.layers[0].dequantized()
    nq = (total - R) // G * G  # keys and values alike
    assert torch.equal(keys[:, :, :nq], fake_quantize(k[:, :, :nq], 4, G, "channel"))
    assert torch.equal(keys[:, :, nq:], k[:, :, nq:])
    assert torch.equal(values[:, :, :nq], fake_quantize(v[:, :, :nq], 2, G, "token"))
    assert torch.equal(values[:, :, nq:], v[:, :, nq:])
    assert R <= total - nq < R + G


def test_quantized_counts_formula():
    L = torch.arange(0, 400)
    nqk, nqv = quantized_counts(L, 32, 128, OTT)
    assert torch.equal(nqk, nqv)
    assert nqk[:160].eq(0).all() and nqk[160] == 128 and nqk[287] == 128 and nqk[288] == 256
    exact = L - nqk
    assert exact[L >= 32].min() == 32 and exact.max() == 32 + 128 - 1


OTT_CONFIGS = [  # (k_bits, v_bits, G, R, S)
    (2, 2, 8, 5, 100),
    (4, 2, 8, 16, 77),
    (2, 4, 16, 3, 40),
    (2, 2, 4, 13, 12),   # S < R + G - 1: the ring holds S rows
    (2, 2, 128, 32, 300),  # OTT's published G and R
]


@pytest.mark.parametrize("flush_under_cond", [False, True], ids=["always", "cond"])
@pytest.mark.parametrize("cfg_s", OTT_CONFIGS, ids=lambda c: "k{}v{}G{}R{}S{}".format(*c))
def test_decomposed_append_matches_reference_bitwise(cfg_s, flush_under_cond):
    k_bits, v_bits, G, R, S = cfg_s
    cfg = ott(k_bits, v_bits, G, R)
    for ref, dec, counts, n, _ in run_pair(cfg, S, seed=S, flush_under_cond=flush_under_cond):
        assert ref.k_res.shape[2] == min(R + G - 1, S)
        for name, a, b in zip(NAMES, ref.kivi, dec.kivi):
            assert torch.equal(a, b), f"{name} differs after appending n={n}, counts={counts}"
    assert (ref.lengths == S).all()


@pytest.mark.parametrize("cfg_s", OTT_CONFIGS, ids=lambda c: "k{}v{}G{}R{}S{}".format(*c))
def test_attention_forms_match_reference(cfg_s):
    # ATOL / RTOL: the sums-order argument of test_decomposed.py holds unchanged (same fp32 sums).
    k_bits, v_bits, G, R, S = cfg_s
    cfg = ott(k_bits, v_bits, G, R)
    for ref, dec, counts, n, gen in run_pair(cfg, S, seed=S + 1):
        params = KIVICache(cfg, num_layers=1, batch_size=1, max_seq_len=S, num_kv_heads=1,
                           head_dim=32).layers[0].params
        B, H = ref.k_codes.shape[:2]
        query = torch.randn(B, 3 * H, n, ref.k_res.shape[-1], generator=gen)
        want = attend_reference(query, ref, counts, params, 0.3)
        for form, attend in (("fused", attend_fused), ("materialized", attend_materialized)):
            got = attend(query, dec, counts, params, 0.3)
            torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL, msg=lambda m: f"{form}, n={n}: {m}")


@pytest.mark.parametrize("q_len", [1, 5])
def test_attend_equals_softmax_over_dequantized(q_len):
    from test_cache import attention_over

    cfg = ott(2, 2, 32, 20)
    torch.manual_seed(2)
    cache = KIVICache(cfg, num_layers=1, batch_size=2, max_seq_len=1200, num_kv_heads=3, head_dim=64)
    n = 1100  # past the reference's 1024-token softmax blocks
    cache.layers[0].append(torch.randn(2, 3, n, 64), torch.randn(2, 3, n, 64))
    query = torch.randn(2, 9, q_len, 64)
    keys, values = cache.layers[0].dequantized()
    expected = attention_over(query, keys, values, 1 / 8, causal_offset=n - q_len)
    torch.testing.assert_close(cache.layers[0].attend(query), expected, rtol=1e-5, atol=1e-5)


def test_exact_when_nothing_left_the_window():
    # fewer than R + G tokens: nothing is quantized, attention is exact
    cfg = ott(2, 2, 128, 32)
    torch.manual_seed(3)
    k, v = torch.randn(1, 3, 159, 64), torch.randn(1, 3, 159, 64)
    cache = KIVICache(cfg, num_layers=1, batch_size=1, max_seq_len=400, num_kv_heads=3, head_dim=64)
    cache.layers[0].append(k, v)
    keys, values = cache.layers[0].dequantized()
    assert torch.equal(keys, k) and torch.equal(values, v)
    cache.layers[0].append(k[:, :, :1], v[:, :, :1])  # the 160th token completes group [0, 128)
    keys, _ = cache.layers[0].dequantized()
    assert not torch.equal(keys[:, :, :128], k[:, :, :128]) and torch.equal(keys[:, :, 128:159], k[:, :, 128:])


def test_ring_bytes():
    # the residual ring holds R + G - 1 tokens per head (keys and values)
    D, S = 64, 4096
    a = KIVICache(ott(2, 2, 128, 32), num_layers=1, batch_size=1, max_seq_len=S, num_kv_heads=1, head_dim=D)
    b = KIVICache(KIVIConfig(2, 2, 128, 128), num_layers=1, batch_size=1, max_seq_len=S, num_kv_heads=1, head_dim=D)
    assert a.layers[0].k_res.shape[2] == 159 and b.layers[0].k_res.shape[2] == 128
    assert a.nbytes() - b.nbytes() == 2 * (159 - 128) * D * 4


# ---------------------------------------------------------------- compile / export

B, H, HQ, D, S = 2, 2, 4, 16, 72
STEP_CFG = ott(2, 4, 8, 5, sink_tokens=1, outlier_tokens=2, outlier_spill=4, outlier_skip_layers=0)


def make_step(portable=False, **mode):
    cache = KIVICache(STEP_CFG, num_layers=1, batch_size=B, max_seq_len=S, num_kv_heads=H, head_dim=D,
                      portable=portable)
    gen = torch.Generator().manual_seed(4)
    # rows at 20 and 12 tokens: row 0 flushes a group at its first step (20 + 1 = 5 + 2 * 8)
    k, v = torch.randn(B, H, 20, D, generator=gen), torch.randn(B, H, 20, D, generator=gen)
    return CacheStep(cache, k, v, torch.tensor([20, 12]), **mode)


def test_compile_fullgraph_through_ops():
    check_compiled_matches_eager(make_step, step_inputs(10, B=B, H=H, HQ=HQ, D=D), through_op=True, atol=0, rtol=0)


@pytest.mark.slow  # Inductor compile, 15-40 s on 2 cores with a cold cache
def test_compile_fullgraph_decomposed():
    check_compiled_matches_eager(make_step, step_inputs(10, B=B, H=H, HQ=HQ, D=D), atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("portable", [False, True], ids=["op", "portable"])
def test_export(portable):
    check_export_matches_eager(make_step, portable, step_inputs(10, B=B, H=H, HQ=HQ, D=D), atol=ATOL, rtol=RTOL)


def test_ops_opcheck():
    step = make_step()
    layer, params = step.cache.layers[0].tensors(), step.cache.layers[0].params
    assert params.flush_policy == OTT
    from kivi_ops.layout import LayerTensors

    clone = LayerTensors(*(None if t is None else t.clone() for t in layer))
    k, v = torch.randn(B, H, 3, D), torch.randn(B, H, 3, D)
    torch.library.opcheck(torch.ops.kivi.cache_append.default, (*clone, k, v, torch.tensor([3, 1]), *params))
    torch.library.opcheck(torch.ops.kivi.cache_attend.default,
                          (torch.randn(B, HQ, 2, D), *layer, torch.tensor([2, 1]), *params, 1 / math.sqrt(D)))


# ---------------------------------------------------------------- errors


@pytest.mark.parametrize("kwargs, match", [
    (dict(flush_policy="OTT"), r"flush_policy must be one of \('kivi', 'ott'\)"),
    (dict(flush_policy=None), "flush_policy must be one of"),
    (dict(group_size=128, residual_length=32), "or flush_policy='ott'"),
    (dict(flush_policy="ott", residual_length=0), "residual_length must be a positive int"),
    (dict(flush_policy="ott", group_size=8, residual_length=32, outlier_tokens=9), "at most group_size=8"),
    (dict(flush_policy="ott", sparse_outliers=0.01), "sparse_outliers is not supported with flush_policy='ott'"),
])
def test_invalid_configs_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        KIVIConfig(**{**dict(k_bits=2, v_bits=2, group_size=32, residual_length=128), **kwargs})


def test_published_config_is_accepted():
    cfg = KIVIConfig(2, 2, 128, 32, outlier_tokens=3, flush_policy="ott")
    assert cfg.residual_slots() == 159 and cfg.key_flush_unit == 128


def test_op_rejects_a_ring_of_the_wrong_policy():
    cache = KIVICache(KIVIConfig(2, 2, 8, 16), num_layers=1, batch_size=1, max_seq_len=64, num_kv_heads=1, head_dim=16)
    layer = cache.layers[0]
    params = layer.params._replace(flush_policy=OTT)  # the ring of a kivi layer has R rows, ott needs R + G - 1
    with pytest.raises(ValueError, match="k_res/v_res must hold 23 residual rows"):
        torch.ops.kivi.cache_append(*layer.tensors(), torch.zeros(1, 1, 1, 16), torch.zeros(1, 1, 1, 16), None,
                                    *params)
    with pytest.raises(ValueError, match="flush_policy must be 0"):
        torch.ops.kivi.cache_attend(torch.zeros(1, 1, 1, 16), *layer.tensors(), None, *layer.params._replace(
            flush_policy=2), 0.25)


@pytest.mark.parametrize("argv, message", [
    (["generate", "--prompt", "x", "--flush-policy", "paper"], "invalid choice: 'paper'"),
    (["generate", "--prompt", "x", "--group-size", "128", "--residual-length", "32"], "--flush-policy"),
    (["generate", "--prompt", "x", "--method", "fp", "--flush-policy", "ott"], "options of the KIVI cache"),
    (["generate", "--prompt", "x", "--flush-policy", "ott", "--group-size", "8", "--outlier-tokens", "9"],
     "--outlier-tokens must be at most --group-size=8"),
])
def test_cli_rejects(argv, message, capsys):
    from kivi_cli.main import main

    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2 and message in capsys.readouterr().err
