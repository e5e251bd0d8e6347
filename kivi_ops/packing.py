"""Reference math for KIVI quantization and bit packing, in plain PyTorch.

This file is the specification the Triton kernels are tested against.

Numerics (KIVI Section 3.1), per group of elements X:
    zero  = min(X)                      stored in the input dtype
    scale = (max(X) - min(X)) / (2^B - 1)  stored in the input dtype
    q     = clamp(floor((X - zero) / scale + 0.5), 0, 2^B - 1)
    X'    = q * scale + zero
Codes are computed from the *stored* (dtype-rounded) scale and zero, so that dequantization
with the stored values is within scale/2 of X. A constant group (max == min) has scale 0, all
codes 0 and reconstructs exactly as zero. Rounding is half-up (floor(v + 0.5)) in both the
reference and the kernels, so codes match bit for bit, ties included. All arithmetic is fp32.

At the dtype's limits (saturate, WIDE_SCALE):
    - scale and zero are finite for every finite group. max - min can overflow fp32 only for bf16
      or fp32 data spanning more than fp32's largest value; such a group's scale is computed from
      max/2 - min/2 and doubled (exact: powers of two commute with rounding), <= 2/3 of the max.
    - X' is computed in fp32 and saturated: clamped to [-finfo(dtype).max, finfo(dtype).max]
      before the cast to the dtype (fp16 [-65504, 65504] at 2 bits: 3 * 43680 - 65504 = 65536).
      The clamp changes only values the cast would make +-inf, and since X lies in
      [-max, max] it moves X' towards X: |X - X'| <= scale/2 (+ roundings) still holds.
    - "Wide" groups (stored scale >= WIDE_SCALE = 2^119: ranges past ~2^120, so bf16 / fp32 data
      only) quantize and dequantize at half scale: X/2, zero/2, scale/2 in the code formula and
      (q * scale/2 + zero/2) * 2 for X', where X - zero or q * scale could overflow fp32. Every
      other group computes exactly the formulas above (times 1), bit for bit as before.

Groups:
    axis="channel" (keys):  G consecutive tokens of one channel. x [..., T, D] -> scale/zero [..., T/G, D]
    axis="token"   (values): G consecutive channels of one token (G clipped to D).
                             x [..., T, D] -> scale/zero [..., T, D/G]

Packed layout (both axes): codes are packed along the channel (last) dimension into uint8,
8/B codes per byte, little end first:
    byte[..., t, j] = sum_i q[..., t, j * (8/B) + i] << (i * B)      for i in [0, 8/B)
so codes have shape [..., T, D * B / 8]. Packing along channels for both axes gives keys and
values one layout: a token's row is contiguous, and the cache appends tokens as rows.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def codes_per_byte(bits: int) -> int:
    return 8 // bits


def token_group_size(group_size: int, head_dim: int) -> int:
    return min(group_size, head_dim)


# Stored scales at or above this are "wide" groups (module doc): with at most 255 codes,
# q * scale < 2^127 below it, and max - min < 2^128 (fp32's range) too.
WIDE_SCALE = 2.0**119


def minmax_scale_zero(x_min: torch.Tensor, x_max: torch.Tensor, bits: int, dtype: torch.dtype):
    """Scale and zero point of each group, rounded to the storage dtype (finite for finite groups:
    a range past fp32's is halved, divided, and doubled)."""
    lo, hi = x_min.float(), x_max.float()
    wide = torch.isinf(hi - lo).float()
    f = 1.0 - 0.5 * wide  # 1, or 0.5 for a range past fp32's
    scale = ((hi * f - lo * f) / (2**bits - 1) * (1.0 + wide)).to(dtype)
    zero = x_min.to(dtype)
    return scale, zero


def nearest_level(normalized: torch.Tensor, levels: torch.Tensor) -> torch.Tensor:
    """Index (int64) of the level nearest to each normalized value (x - zero) / scale, for levels
    sorted ascending: nuq's one quantize-to-levels rule, used by the cache (quantize_codes), fake
    quantization and the k-means calibration (nuq.py) alike. A value exactly halfway between two
    levels goes to the upper one, like the uniform grid's round-half-up floor(v + 0.5), so uniform
    levels 0..2^B-1 give the uniform codes, ties included. The Triton kernels count midpoints the
    same way (triton_quant.py)."""
    midpoints = (levels[1:] + levels[:-1]) / 2
    return torch.bucketize(normalized.contiguous(), midpoints.to(normalized.device), right=True)


def half_if_wide(scale: torch.Tensor) -> torch.Tensor:
    """fp32 factor per group: 0.5 for wide groups (stored scale >= WIDE_SCALE), else 1."""
    return 1.0 - 0.5 * (scale.float() >= WIDE_SCALE).float()


def saturate(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp32 x clamped to dtype's finite range (still fp32; NaN stays NaN): the cast to dtype that
    follows cannot overflow, and values it would keep finite are unchanged."""
    m = torch.finfo(dtype).max
    return x.clamp(-m, m)


def quantize_codes(x: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int,
                   levels: torch.Tensor | None = None) -> torch.Tensor:
    """Integer codes of x given broadcastable scale/zero (any shape); returns uint8 codes.
    levels (nuqX, see nuq.py): the code is the index of the level nearest to (x - zero) / scale
    (nearest_level: ties go up like the uniform rounding)."""
    s = scale.float()
    safe = torch.where(s == 0, torch.ones_like(s), s)
    if levels is not None:
        return nearest_level((x.float() - zero.float()) / safe, levels).to(torch.uint8)
    q = torch.floor((x.float() - zero.float()) / safe + 0.5)
    return q.clamp_(0, 2**bits - 1).to(torch.uint8)


def code_values(codes: torch.Tensor, levels: torch.Tensor | None) -> torch.Tensor:
    """fp32 values the codes stand for before scale and zero: the codes themselves (uniform
    grid) or, with nuq levels, levels[code]."""
    if levels is None:
        return codes.float()
    return levels.float()[codes.long()]


def dequantize_float(c: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """fp32 c * scale + zero (c: fp32 code values), wide groups at half scale (module doc)."""
    f = half_if_wide(scale)
    return (c * (scale.float() * f) + zero.float() * f) * (1.0 / f)


def dequantize_codes(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return saturate(dequantize_float(q.float(), scale, zero), dtype).to(dtype)


def pack(q: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 codes [..., D] (each < 2^bits) -> packed uint8 [..., D * bits / 8]."""
    per = codes_per_byte(bits)
    if per == 1:
        return q.contiguous()
    q = q.reshape(*q.shape[:-1], q.shape[-1] // per, per).to(torch.int32)
    # sum_i q_i << (i * bits) by Horner's rule with integer constants: exact, core ATen ops the
    # ONNX and ExecuTorch exporters take (shifts are not core ATen; ONNX lacks __lshift__), and
    # elementwise work Inductor fuses (a tensor of powers 2 ** arange would be an aten.pow call).
    packed = q[..., per - 1]
    for i in range(per - 2, -1, -1):
        packed = packed * 2**bits + q[..., i]
    return packed.to(torch.uint8)


def unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """packed uint8 [..., D * bits / 8] -> uint8 codes [..., D]."""
    per = codes_per_byte(bits)
    if per == 1:
        return packed
    shifts = torch.arange(per, device=packed.device, dtype=torch.int32) * bits
    q = torch.bitwise_right_shift(packed.to(torch.int32).unsqueeze(-1), shifts) & (2**bits - 1)
    return q.reshape(*packed.shape[:-1], packed.shape[-1] * per).to(torch.uint8)


@functools.lru_cache(maxsize=None)
def _unpack_table(bits: int, device: str) -> torch.Tensor:
    """[256, 8/B] float32: the codes held by each possible byte."""
    per = codes_per_byte(bits)
    byte = torch.arange(256, dtype=torch.int32)[:, None]
    return ((byte >> (torch.arange(per, dtype=torch.int32) * bits)) & (2**bits - 1)).float().to(device)


def unpack_float(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """unpack(packed, bits).float(), as one table lookup per byte (3x faster on CPU)."""
    codes = F.embedding(packed.long(), _unpack_table(bits, str(packed.device)))
    return codes.reshape(*packed.shape[:-1], packed.shape[-1] * codes_per_byte(bits))


def quantize_pack_reference(x: torch.Tensor, bits: int, group_size: int, axis: str,
                            levels: torch.Tensor | None = None, exclude: torch.Tensor | None = None):
    """x [..., T, D] -> (codes [..., T, D*B/8] uint8, scale, zero) as described above.

    levels: nuq levels (quantize_codes). exclude (x's shape, bool): elements kept out of their
    group's min/max (dense-and-sparse outliers stored exactly elsewhere; their codes saturate);
    a group with every element excluded gets scale 0 and zero 0."""
    *lead, T, D = x.shape
    if axis == "channel":
        shape, dim = (*lead, T // group_size, group_size, D), -2
    else:
        gs = token_group_size(group_size, D)
        shape, dim = (*lead, T, D // gs, gs), -1
    g = x.reshape(shape)
    if exclude is None:
        lo, hi = g.amin(dim=dim), g.amax(dim=dim)
    else:
        e = exclude.reshape(shape)
        lo = g.masked_fill(e, float("inf")).amin(dim=dim)
        hi = g.masked_fill(e, float("-inf")).amax(dim=dim)
        empty = e.all(dim=dim)
        lo, hi = lo.masked_fill(empty, 0.0), hi.masked_fill(empty, 0.0)
    scale, zero = minmax_scale_zero(lo, hi, bits, x.dtype)
    f = half_if_wide(scale).unsqueeze(dim)  # 1 but for wide groups (module doc): exact either way
    q = quantize_codes(g * f, scale.unsqueeze(dim) * f, zero.unsqueeze(dim) * f, bits, levels).reshape(*lead, T, D)
    return pack(q, bits), scale, zero


def expand_groups(t: torch.Tensor, group_size: int, axis: str, head_dim: int) -> torch.Tensor:
    """Repeat per-group scale/zero to one value per element of [..., T, D]."""
    if axis == "channel":
        return t.repeat_interleave(group_size, dim=-2)
    return t.repeat_interleave(token_group_size(group_size, head_dim), dim=-1)


def unpack_dequantize_reference(
    codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int, group_size: int, axis: str
) -> torch.Tensor:
    q = unpack(codes, bits)
    D = q.shape[-1]
    s = expand_groups(scale, group_size, axis, D)
    z = expand_groups(zero, group_size, axis, D)
    return dequantize_codes(q, s, z, scale.dtype)
