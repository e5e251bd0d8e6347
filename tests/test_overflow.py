"""Overflow at the dtype limits: finite inputs must store finite scale/zero, dequantize to finite
values within the quantization error bound, and give finite attention outputs, in every path.

The failure these guard against: a group spanning [-65504, 65504] (fp16) stores scale
131008 / 3 = 43669.3 -> 43680 (fp16), and its top code reconstructs to 3 * 43680 - 65504 = 65536,
past fp16's largest finite value: the cast back to fp16 gave +inf (likewise [0, 65504]:
3 * 21840 = 65520, which rounds to inf). In bf16, max - min of a group spanning
[-max, max] overflows fp32 itself (the stored scale was inf).

The rule checked here (packing.py): scale and zero are finite for every finite group; a
reconstruction is computed in fp32 and saturated to the dtype's finite range when it is rounded
to the dtype, so |x - x'| <= scale / 2 (+ the dtype's roundings) still holds: x lies in the
range, and clamping x' to the range only moves it towards x.

Triton kernels run in the interpreter without CUDA (TRITON_INTERPRET=1 before the kernel imports).
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

import kivi_ops  # noqa: E402,F401  (registers the ops)
from kivi_ops import KIVICache, KIVIConfig  # noqa: E402
from kivi_ops.options.extras import NO_EXTRAS, Extras  # noqa: E402
from kivi_ops.kernels.decomposed.append import append_decomposed  # noqa: E402
from kivi_ops.kernels.decomposed.attend import attend_fused, attend_materialized  # noqa: E402
from kivi_ops.kernels.reference import append_reference, materialize_block  # noqa: E402
from kivi_ops.kernels.triton.append import append_triton  # noqa: E402
from kivi_ops.kernels.triton.decode import attend_decode  # noqa: E402
from kivi_ops.kernels.triton.quant import quantize_pack_triton, unpack_dequantize_triton  # noqa: E402
from kivi_ops.kernels.triton.split import attend_split  # noqa: E402
from kivi_ops.layout import LayerTensors, QuantParams  # noqa: E402
from kivi_ops.calibration.nuq import uniform_levels  # noqa: E402
from kivi_ops.kernels.reference.packing import (packed_bytes, expand_groups, quantize_pack_reference,  # noqa: E402
                                                unpack_dequantize_reference)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FP16_MAX = torch.finfo(torch.float16).max  # 65504


def limit_groups(dtype, G, gen):
    """[8, G] fp32 group contents (each row one group, exactly representable in dtype): the full
    finite range, [0, max], constant max, constant -max, [-max, 0], just below max, a random
    range near max, and an ordinary group."""
    M = torch.finfo(dtype).max

    def spread(lo, hi):
        g = lo + (hi - lo) * torch.rand(G, generator=gen, dtype=torch.float64)
        g[0], g[-1] = lo, hi
        return g.float().to(dtype).float()

    rows = [spread(-M, M), spread(0.0, M), torch.full((G,), M), torch.full((G,), -M), spread(-M, 0.0),
            spread(M * (1 - 2**-6), M), spread(M / 2, M), torch.randn(G, generator=gen)]
    return torch.stack([r.to(dtype).float() for r in rows])


def limit_tensor(dtype, G, D, axis, seed=0):
    """x [T, D] in dtype whose groups (along axis) are limit_groups, cycled over the columns / rows."""
    gen = torch.Generator().manual_seed(seed)
    if axis == "channel":  # a group = G tokens of one channel: x [G, D]
        cols = [limit_groups(dtype, G, gen)[d % 8] for d in range(D)]
        x = torch.stack(cols, dim=1)
    else:  # a group = G channels of one token: x [8, D] with D // G groups per row
        x = torch.stack([torch.cat([limit_groups(dtype, G, gen)[(t + j) % 8] for j in range(D // G)])
                         for t in range(8)])
    return x.to(dtype)


def error_bound(x, s, bits):
    """scale/2 in exact arithmetic; storage adds the dtype's rounding of the scale (times up to
    2^B - 1 codes) and of the reconstruction (and fp32's, ~2^-24 of the range). In fp64: at
    bf16's limits, these sums overflow fp32."""
    eps = torch.finfo(x.dtype).eps
    s = s.double()
    return s / 2 + eps * (x.double().abs() + (2**bits) * s) + 1e-30


def error(a, b):
    """|a - b| in fp64 (a difference of values near bf16's max overflows fp32)."""
    return (a.double() - b.double()).abs()


def check_dequantized(x, codes, scale, zero, out, bits, G, axis):
    assert torch.isfinite(scale).all() and torch.isfinite(zero).all(), "a finite group stored a non-finite scale/zero"
    assert (scale >= 0).all()
    assert out.dtype == x.dtype and out.shape == x.shape
    assert torch.isfinite(out).all(), "finite input dequantized to inf/nan"
    s = expand_groups(scale, G, axis, x.shape[-1])
    err = error(out, x)
    bound = error_bound(x, s, bits)
    assert (err <= bound).all(), f"error {float((err - bound).max())} past the bound"


@pytest.mark.parametrize("impl", ("op", "triton"))
@pytest.mark.parametrize("bits", (2, 4, 8))
@pytest.mark.parametrize("axis", ("channel", "token"))
@pytest.mark.parametrize("dtype", (torch.float16, torch.bfloat16), ids=("fp16", "bf16"))
def test_quantize_dequantize_at_dtype_limits(dtype, axis, bits, impl):
    G, D = 16, 64
    x = limit_tensor(dtype, G, D, axis, seed=bits)
    if impl == "op":
        codes, scale, zero = torch.ops.kivi.quantize_pack(x, bits, G, axis)
        out = torch.ops.kivi.unpack_dequantize(codes, scale, zero, bits, G, axis)
    else:
        codes, scale, zero = (t.cpu() for t in quantize_pack_triton(x.to(DEVICE), bits, G, axis))
        out = unpack_dequantize_triton(codes.to(DEVICE), scale.to(DEVICE), zero.to(DEVICE), bits, G, axis).cpu()
        # the kernels follow the reference bit for bit at the limits too
        r_codes, r_scale, r_zero = quantize_pack_reference(x, bits, G, axis)
        assert torch.equal(scale, r_scale) and torch.equal(zero, r_zero) and torch.equal(codes, r_codes)
        ref = unpack_dequantize_reference(codes, scale, zero, bits, G, axis)
        if DEVICE == "cpu":  # the interpreter: no FMA contraction, the same fp32 ops
            assert torch.equal(out, ref)
    check_dequantized(x, codes, scale, zero, out, bits, G, axis)
    # a constant group reconstructs exactly, max included
    if axis == "channel":
        M = torch.finfo(dtype).max
        assert (out[:, 2::8].float() == M).all() and (out[:, 3::8].float() == -M).all()


# ---------------------------------------------------------------- the cache

CFG = KIVIConfig(k_bits=2, v_bits=2, group_size=8, residual_length=16)
B, H, S, D = 1, 2, 128, 64


def limit_kv(dtype, B, H, S, D, G, seed=0):
    """keys, values [B, H, S, D] (dtype) whose key groups (G tokens of a channel) and value groups
    (G channels of a token) reach the dtype's limits: the key channels cycle through
    limit_groups (fresh random contents per group); the value rows alternate between a pattern of
    limit groups and the same pattern with its odd groups rotated by one channel (same scales and
    zeros). Even groups hold still: the full-range group's top channel averages to about the max
    in any attention output (its top code reconstructs past it). In the odd groups a top code
    ([0, max]: 3 * 21840 = 65520 in fp16) is averaged with other values: outputs stay clear of
    the max, so a dequantized tile that overflowed would show."""
    gen = torch.Generator().manual_seed(seed)
    keys = torch.empty(B, H, S, D)
    for g in range(S // G):
        for d in range(D):
            keys[..., g * G:(g + 1) * G, d] = limit_groups(dtype, G, gen)[(d + g) % 8]
    pattern = torch.cat([limit_groups(dtype, G, gen)[j % 8] for j in range(D // G)])
    rotated = pattern.view(D // G, G).clone()
    rotated[1::2] = rotated[1::2].roll(1, -1)
    rotated = rotated.flatten()
    values = torch.stack([pattern, rotated])[torch.arange(S) % 2]
    return keys.to(dtype), values.expand(B, H, S, D).to(dtype).contiguous()


def _buffers(B, H, S, D, R, G, k_bits, v_bits, dtype):
    gv, ng = min(G, D), -(-S // G)
    shapes = [((B, H, S, packed_bytes(D, k_bits)), torch.uint8), ((B, H, ng, D), dtype), ((B, H, ng, D), dtype),
              ((B, H, min(R, S), D), dtype), ((B, H, S, packed_bytes(D, v_bits)), torch.uint8),
              ((B, H, S, D // gv), dtype), ((B, H, S, D // gv), dtype), ((B, H, min(R, S), D), dtype),
              ((B,), torch.int64)]
    return [torch.zeros(shape, dtype=dt, device=DEVICE) for shape, dt in shapes]


@pytest.mark.parametrize("nuq", (False, True), ids=("uniform", "nuq"))
@pytest.mark.parametrize("dtype", (torch.float16, torch.bfloat16), ids=("fp16", "bf16"))
def test_append_at_dtype_limits(dtype, nuq):
    """The three appends (reference, decomposed, Triton) store the same bits at the limits, with
    finite scales and zeros, and the materialized cache is within the dtype's range and the
    error bound (nuq: the uniform grid as levels, so the bound is the same)."""
    B, H, S, D, R, G, kb, vb = 2, 1, 48, 32, 16, 8, 2, 4
    keys, values = limit_kv(dtype, B, H, S, D, G, seed=int(nuq))
    extras = Extras(k_levels=uniform_levels(kb), v_levels=uniform_levels(vb)) if nuq else NO_EXTRAS
    params = QuantParams(kb, vb, G, R)
    caches = [_buffers(B, H, S, D, R, G, kb, vb, dtype) for _ in range(3)]
    appends = (append_reference, append_decomposed, append_triton)
    for n0, n1 in ((0, 21), (21, 22), (22, 40), (40, S)):  # chunks and a decode step, across flushes
        for cache, append in zip(caches, appends):
            ex = Extras(*(None if t is None else t.to(DEVICE) for t in extras))
            append(LayerTensors(*cache, None, None, None, **ex._asdict()), keys[:, :, n0:n1].to(DEVICE),
                   values[:, :, n0:n1].to(DEVICE), None, params)
    ref = caches[0]
    for other in caches[1:]:
        for a, b in zip(ref, other):
            assert torch.equal(a.cpu(), b.cpu())
    assert all(torch.isfinite(t).all() for t in ref[1:3] + ref[5:7]), "non-finite scale/zero"
    k, v = materialize_block(LayerTensors(*[t.cpu() for t in ref], None, None, None, **extras._asdict()), 0, S,
                             params)
    M = torch.finfo(dtype).max
    assert (k.abs() <= M).all() and (v.abs() <= M).all(), "dequantized past the dtype's range"
    ks = expand_groups(ref[1].cpu(), G, "channel", D)
    vs = expand_groups(ref[5].cpu(), G, "token", D)
    nqk, nqv = S // R * R, S - R
    assert (error(k, keys)[:, :, :nqk] <= error_bound(keys, ks, kb)[:, :, :nqk]).all()
    assert (error(v, values)[:, :, :nqv] <= error_bound(values, vs, vb)[:, :, :nqv]).all()


def limit_cache(seed=0):
    """An fp16 KIVICache filled to S tokens of limit_kv."""
    keys, values = limit_kv(torch.float16, B, H, S, D, CFG.group_size, seed)
    keys, values = keys.float(), values.float()
    cache = KIVICache(CFG, num_layers=1, batch_size=B, max_seq_len=S, num_kv_heads=H, head_dim=D,
                      dtype=torch.float16)
    cache.layers[0].append(keys[:, :, :100].half(), values[:, :, :100].half())
    for t in range(100, S):  # decode steps: flushes and values leaving the window one at a time
        cache.layers[0].append(keys[:, :, t:t + 1].half(), values[:, :, t:t + 1].half())
    return cache, keys.half(), values.half()


@pytest.fixture(scope="module")
def filled():
    return limit_cache()


def test_cache_dequantized_is_finite(filled):
    cache, keys, values = filled
    layer = cache.layers[0].tensors()
    assert all(torch.isfinite(t).all() for t in (layer.k_scale, layer.k_zero, layer.v_scale, layer.v_zero))
    k, v = cache.layers[0].dequantized()
    assert torch.isfinite(k).all() and torch.isfinite(v).all(), "dequantized() is not finite"
    G = CFG.group_size
    ks = expand_groups(layer.k_scale, G, "channel", D)
    vs = expand_groups(layer.v_scale, G, "token", D)
    assert (error(k, keys) <= error_bound(keys, ks, CFG.k_bits)).all()
    assert (error(v, values) <= error_bound(values, vs, CFG.v_bits)).all()


def _query(q_len, seed=1):
    # small enough that scores against keys of +-65504 stay O(1): the softmax spreads its weight
    # over many tokens, most of them quantized (112 of 128 values)
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(B, 3 * H, q_len, D, generator=gen) * 2e-5).half()


def _on_device(cache):
    return LayerTensors(*(None if t is None else t.to(DEVICE) for t in cache.layers[0].tensors()))


ATTEND = {
    "reference": lambda q, c, p, s, n: c.layers[0].attend(q, scale=s),  # CPU eager: the reference kernel in the op
    "fused": lambda q, c, p, s, n: attend_fused(q, c.layers[0].tensors(), None, p, s),
    "materialized": lambda q, c, p, s, n: attend_materialized(q, c.layers[0].tensors(), None, p, s),
    # num_splits 1: the kernel writes the output; 2: the reduce kernel does
    "split": lambda q, c, p, s, n: attend_split(q.to(DEVICE), _on_device(c), None, p, s, num_splits=n).cpu(),
    "decode": lambda q, c, p, s, n: attend_decode(q.to(DEVICE), _on_device(c), None, p, s, num_splits=n).cpu(),
}


@pytest.mark.parametrize("path,q_len,splits", [
    ("reference", 1, 1), ("fused", 1, 1), ("materialized", 1, 1), ("split", 1, 1), ("split", 1, 2),
    ("decode", 1, 1), ("decode", 1, 2), ("reference", 4, 1), ("materialized", 4, 1), ("split", 4, 2)])
def test_cache_attend_is_finite(filled, path, q_len, splits):
    cache, keys, values = filled
    query = _query(q_len)
    params, scale = cache.layers[0].params, D**-0.5
    out = ATTEND[path](query, cache, params, scale, splits)
    assert out.dtype == torch.float16 and out.shape == query.shape
    assert torch.isfinite(out).all(), f"{path}: attention output is not finite"
    # every path agrees with attention over the dequantized cache (fp32 math), within the fp16
    # roundings of the output and, on the split kernel's tensor-core path, of keys and values;
    # atol 64 (2 ulps at 65504): paths that fold scales into sums see a top code unsaturated
    # (65536 where dequantized() holds 65504), an output difference <= 32
    k, v = cache.layers[0].dequantized()
    groups = query.shape[1] // H
    kf, vf = k.float().repeat_interleave(groups, 1), v.float().repeat_interleave(groups, 1)
    scores = query.float() @ kf.transpose(-1, -2) * scale
    if q_len > 1:
        pos = S - q_len + torch.arange(q_len)
        scores = scores.masked_fill(torch.arange(S)[None, :] > pos[:, None], float("-inf"))
    want = torch.softmax(scores, dim=-1) @ vf
    torch.testing.assert_close(out.float(), want.clamp(-FP16_MAX, FP16_MAX), rtol=4e-3, atol=64)
