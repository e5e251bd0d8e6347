"""The Triton append and attention kernels under OTT's flush policy (flush_policy=1,
kivi_ops/options/schedule.py) against the CPU reference, bit for bit for appends, within the
attention tolerance of tests/test_triton_kernels.py for attention. Without CUDA the kernels run
in Triton's interpreter (TRITON_INTERPRET=1, set before the kernel modules are imported)."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from kivi_ops.kernels.reference import append_reference, attend_reference  # noqa: E402
from kivi_ops.kernels.triton.append import append_triton  # noqa: E402
from kivi_ops.kernels.triton.decode import attend_decode  # noqa: E402
from kivi_ops.kernels.triton.split import attend_split  # noqa: E402
from kivi_ops.layout import LayerTensors, QuantParams  # noqa: E402
from kivi_ops.kernels.reference.packing import codes_per_byte  # noqa: E402
from kivi_ops.options.schedule import OTT  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BUFFERS = ("k_codes", "k_scale", "k_zero", "k_res", "v_codes", "v_scale", "v_zero", "v_res", "lengths")
POOL = ("pool_k", "pool_v", "pool_pos")


def make_cache(B, H, S, D, R, G, k_bits, v_bits, dtype):
    """The nine buffers of an ott-policy layer: the residual ring holds min(R + G - 1, S) rows."""
    gv, ng, W = min(G, D), -(-S // G), min(R + G - 1, S)
    shapes = [((B, H, S, D // codes_per_byte(k_bits)), torch.uint8), ((B, H, ng, D), dtype), ((B, H, ng, D), dtype),
              ((B, H, W, D), dtype), ((B, H, S, D // codes_per_byte(v_bits)), torch.uint8),
              ((B, H, S, D // gv), dtype), ((B, H, S, D // gv), dtype), ((B, H, W, D), dtype), ((B,), torch.int64)]
    return [torch.zeros(*shape, dtype=dt) for shape, dt in shapes]


def make_pool(B, H, P, D, dtype):
    return [torch.zeros(B, H, P, D, dtype=dtype), torch.zeros(B, H, P, D, dtype=dtype),
            torch.full((B, H, P), -1, dtype=torch.int64)]


def layer(bufs, pool=None):
    return LayerTensors(*bufs, *(pool or (None, None, None)))


def _dev(t):
    return None if t is None else t.to(DEVICE, copy=True)


def keys_with_outliers(B, H, n, D, gen):
    key = torch.randn(B, H, n, D, generator=gen)
    key[..., 3] += 4.0
    return torch.where(torch.rand(B, H, n, 1, generator=gen) < 0.2, key * 0.1, key)


# (n, counts) per step: ragged prefill chunks, decode steps crossing several group flushes at
# different steps per row, a row that appends nothing, a chunk that flushes more than n tokens.
SCHEDULE = ([(3, [3, 1, 0]), (20, [20, 13, 2])] + [(1, [1, 1, int(s % 3 != 0)]) for s in range(17)]
            + [(2, [2, 2, 1]), (9, [9, 4, 9])] + [(1, None)] * 4)

CASES = {  # name: (dtype, k_bits, v_bits, D, G, R, (sink, outliers, spill) or None)
    "fp32-g8-r5": (torch.float32, 2, 4, 64, 8, 5, None),
    "fp16-g16-r3-d128": (torch.float16, 4, 2, 128, 16, 3, None),
    "fp32-g8-r5-pool": (torch.float32, 2, 2, 64, 8, 5, (1, 2, 3)),
    "bf16-g4-r7-pool": (torch.bfloat16, 2, 4, 64, 4, 7, (0, 3, 4)),
}


# The interpreter is slow (each case 35-200 s on the shared 2-core machine): `make test` runs the
# pool case (the four-launch path, the one-launch decode kernel and the OTT step), the rest is slow.
FAST_APPEND = ("fp32-g8-r5-pool",)


@pytest.mark.parametrize("name", [pytest.param(n, marks=[] if n in FAST_APPEND else [pytest.mark.slow])
                                  for n in CASES])
def test_append_matches_reference(name):
    """Prefill chunks (the four-launch path), decode steps (the one-launch kernel: a group of G
    keys and values quantized at once, the OTT step with a pool) and chunks, ragged counts:
    every buffer (and the pool) bit for bit the reference's."""
    dtype, k_bits, v_bits, D, G, R, pool_cfg = CASES[name]
    B, H, S = 3, 2, 72
    sink, n_out, spill = pool_cfg or (0, 0, 0)
    params = QuantParams(k_bits, v_bits, G, R, sink, n_out, OTT)
    ref = make_cache(B, H, S, D, R, G, k_bits, v_bits, dtype)
    pool = make_pool(B, H, sink + n_out + spill, D, dtype) if pool_cfg else None
    tri, dev_pool = [_dev(t) for t in ref], None if pool is None else [_dev(t) for t in pool]
    gen = torch.Generator().manual_seed(7)
    flushed = False
    for step, (n, counts) in enumerate(SCHEDULE):
        key = keys_with_outliers(B, H, n, D, gen).to(dtype)
        value = torch.randn(B, H, n, D, generator=gen).to(dtype)
        c = None if counts is None else torch.tensor(counts)
        append_reference(layer(ref, pool), key, value, c, params)
        append_triton(layer(tri, dev_pool), _dev(key), _dev(value), _dev(c), params)
        for bn, a, b in zip(BUFFERS, tri, ref):
            assert torch.equal(a.cpu(), b), f"{bn} differs after step {step} (n={n}, counts={counts})"
        for bn, a, b in zip(POOL, dev_pool or (), pool or ()):
            assert torch.equal(a.cpu(), b), f"{bn} differs after step {step}"
        flushed = flushed or bool((ref[-1] >= R + G).any())
    assert flushed and ref[-1].tolist() == [55, 41, 27]
    if pool_cfg:
        assert (pool[2][..., sink:sink + n_out] >= 0).any(), "no outlier was ever chosen"


def _attend_case(dtype, D, G, R, lengths, q_len, counts, pool_cfg=None, seed=0):
    B, H, Hq, S = len(lengths), 2, 6, 96
    sink, n_out, spill = pool_cfg or (0, 0, 0)
    params = QuantParams(2, 4, G, R, sink, n_out, OTT)
    cache = make_cache(B, H, S, D, R, G, 2, 4, dtype)
    pool = make_pool(B, H, sink + n_out + spill, D, dtype) if pool_cfg else None
    gen = torch.Generator().manual_seed(seed)
    L = torch.tensor(lengths)
    first = (L - 4).clamp(min=0)
    n = int(first.max())
    append_reference(layer(cache, pool), keys_with_outliers(B, H, n, D, gen).to(dtype),
                     torch.randn(B, H, n, D, generator=gen).to(dtype), first, params)
    for _ in range(4):
        c = (L - cache[-1]).clamp(max=1)
        append_reference(layer(cache, pool), keys_with_outliers(B, H, 1, D, gen).to(dtype),
                         torch.randn(B, H, 1, D, generator=gen).to(dtype), c, params)
    assert cache[-1].tolist() == lengths
    query = torch.randn(B, Hq, q_len, D, generator=gen).to(dtype)
    cnt = None if counts is None else torch.tensor(counts)
    want = attend_reference(query, layer(cache, pool), cnt, params, D ** -0.5)
    dev = layer([_dev(t) for t in cache], None if pool is None else [_dev(t) for t in pool])
    return query, dev, cnt, params, want


# Tolerance: as in tests/test_triton_kernels.py, the kernels sum in other orders (tiles, splits,
# base-2 exponentials) in fp32: ~1e-6 relative in fp32; fp16/bf16 outputs are compared after the
# cast to their dtype (a few ulps of the output, 2e-2 for bf16's 8-bit mantissa).
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


ATTEND_CASES = {
    "fp32": (torch.float32, 64, 8, 5, [70, 13, 4], None),  # quantized groups, a row below R + G, one below R
    "fp16": (torch.float16, 64, 16, 3, [90, 33, 19], None),
    "pool": (torch.float32, 64, 8, 5, [70, 40, 21], (1, 2, 3)),  # pooled tokens masked, attended exact
}


# The decode kernel is the slow one in the interpreter (~30 s a case): make test runs its pool
# case and every split case (~7 s each).
@pytest.mark.parametrize("kernel, case", [
    pytest.param(k, c, marks=[pytest.mark.slow] if k == "decode" and c != "pool" else [], id=f"{k}-{c}")
    for k in ("decode", "split") for c in ATTEND_CASES])
def test_attend_matches_reference(kernel, case):
    dtype, D, G, R, lengths, pool_cfg = ATTEND_CASES[case]
    query, dev, cnt, params, want = _attend_case(dtype, D, G, R, lengths, 1, None, pool_cfg)
    fn = attend_decode if kernel == "decode" else attend_split
    got = fn(_dev(query), dev, None, params, D ** -0.5).cpu()
    tol = TOL[dtype]
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


def test_attend_split_chunk_queries():
    # q_len > 1 with ragged counts (a prefill chunk's causal queries over the ott ring)
    query, dev, cnt, params, want = _attend_case(torch.float32, 64, 8, 5, [70, 30, 12], 4, [4, 2, 0])
    got = attend_split(_dev(query), dev, _dev(cnt), params, 64 ** -0.5).cpu()
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
