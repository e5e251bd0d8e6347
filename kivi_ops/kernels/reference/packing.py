"""Reference math for KIVI quantization and bit packing in plain PyTorch: the specification the
kernels are tested against (numerics, groups, layout, 3-bit planes, wide groups: docs/cache.md)."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def codes_per_word(bits: int) -> int:
    return 8 if bits == 3 else 8 // bits


def word_bytes(bits: int) -> int:
    return 3 if bits == 3 else 1


def packed_bytes(head_dim: int, bits: int) -> int:
    return head_dim // codes_per_word(bits) * word_bytes(bits)


def codes_per_byte(bits: int) -> int:
    if bits == 3:
        raise ValueError("3-bit codes pack 8 per 3 bytes, not a whole number per byte: use "
                         "codes_per_word(3) = 8 and word_bytes(3) = 3 (kivi_ops.kernels.reference.packing)")
    return 8 // bits


def token_group_size(group_size: int, head_dim: int) -> int:
    return min(group_size, head_dim)


# Stored scales at or above this are "wide" groups: with at most 255 codes, q * scale < 2^127
# below it, and max - min < 2^128 too.
WIDE_SCALE = 2.0**119


def minmax_scale_zero(x_min: torch.Tensor, x_max: torch.Tensor, bits: int, dtype: torch.dtype):
    """Per-group scale and zero in the storage dtype; a range past fp32's is halved, divided, doubled."""
    lo, hi = x_min.float(), x_max.float()
    wide = torch.isinf(hi - lo).float()
    f = 1.0 - 0.5 * wide  # 1, or 0.5 for a range past fp32's
    scale = ((hi * f - lo * f) / (2**bits - 1) * (1.0 + wide)).to(dtype)
    zero = x_min.to(dtype)
    return scale, zero


def nearest_level(normalized: torch.Tensor, levels: torch.Tensor) -> torch.Tensor:
    """int64 index of the level nearest each (x - zero) / scale (levels ascending); a tie goes to the
    upper level, like the uniform grid's floor(v + 0.5), and like the Triton kernels."""
    midpoints = (levels[1:] + levels[:-1]) / 2
    if torch.compiler.is_compiling():
        # Traced: bucketize is not core ATen (ExecuTorch refuses it); count midpoints with a sum.
        return (midpoints.to(normalized.device) <= normalized[..., None]).sum(-1)
    return torch.bucketize(normalized.contiguous(), midpoints.to(normalized.device), right=True)


def half_if_wide(scale: torch.Tensor) -> torch.Tensor:
    return 1.0 - 0.5 * (scale.float() >= WIDE_SCALE).float()


def saturate(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp32 x clamped to dtype's finite range, so the cast cannot overflow; NaN stays NaN."""
    m = torch.finfo(dtype).max
    return x.clamp(-m, m)


def quantize_codes(x: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int,
                   levels: torch.Tensor | None = None) -> torch.Tensor:
    """uint8 codes of x for broadcastable scale/zero; with nuq levels, the nearest level's index."""
    s = scale.float()
    safe = torch.where(s == 0, torch.ones_like(s), s)
    if levels is not None:
        return nearest_level((x.float() - zero.float()) / safe, levels).to(torch.uint8)
    q = torch.floor((x.float() - zero.float()) / safe + 0.5)
    return q.clamp_(0, 2**bits - 1).to(torch.uint8)


def code_values(codes: torch.Tensor, levels: torch.Tensor | None) -> torch.Tensor:
    if levels is None:
        return codes.float()
    return levels.float()[codes.long()]


def dequantize_float(c: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """fp32 c * scale + zero, wide groups at half scale."""
    f = half_if_wide(scale)
    return (c * (scale.float() * f) + zero.float() * f) * (1.0 / f)


def dequantize_codes(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return saturate(dequantize_float(q.float(), scale, zero), dtype).to(dtype)


def pack(q: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 codes [..., D] -> packed uint8 [..., D * bits / 8]."""
    per = codes_per_word(bits)
    if per == 1:
        return q.contiguous()
    q = q.reshape(*q.shape[:-1], q.shape[-1] // per, per).to(torch.int32)
    # Horner's rule with integer constants: shifts are not core ATen and ONNX lacks __lshift__;
    # 2 ** arange would be an aten.pow call Inductor does not fuse.
    packed = q[..., per - 1]
    for i in range(per - 2, -1, -1):
        packed = packed * 2**bits + q[..., i]
    if word_bytes(bits) == 1:
        return packed.to(torch.uint8)
    planes = torch.stack([torch.remainder(packed, 256),
                          torch.remainder(torch.div(packed, 256, rounding_mode="floor"), 256),
                          torch.div(packed, 65536, rounding_mode="floor")], -2)
    return planes.reshape(*packed.shape[:-1], 3 * packed.shape[-1]).to(torch.uint8)


def unpack_words(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """packed uint8 [..., D * bits / 8] -> int32 words [..., D / codes_per_word(bits)]."""
    b = packed.to(torch.int32)
    if word_bytes(bits) == 1:
        return b
    nw = packed.shape[-1] // 3
    return b[..., :nw] + b[..., nw : 2 * nw] * 256 + b[..., 2 * nw :] * 65536


def unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """packed uint8 [..., D * bits / 8] -> uint8 codes [..., D]."""
    per = codes_per_word(bits)
    if per == 1:
        return packed
    words = unpack_words(packed, bits)
    shifts = torch.arange(per, device=packed.device, dtype=torch.int32) * bits
    q = torch.bitwise_right_shift(words.unsqueeze(-1), shifts) & (2**bits - 1)
    return q.reshape(*words.shape[:-1], words.shape[-1] * per).to(torch.uint8)


def three_bit_codes_float(packed: torch.Tensor, dim: int) -> torch.Tensor:
    """fp32 codes of 3-bit rows [..., 3 * NW] stacked at dim, in exact fp32 arithmetic that vectorizes."""
    nw = packed.shape[-1] // 3
    b = packed.float()
    w = b[..., :nw] + b[..., nw : 2 * nw] * 256.0 + b[..., 2 * nw :] * 65536.0
    return torch.stack([torch.floor(w * 2.0 ** (-3 * i)) - 8.0 * torch.floor(w * 2.0 ** (-3 * i - 3))
                        for i in range(8)], dim)


@functools.lru_cache(maxsize=None)
def _unpack_table(bits: int, device: str) -> torch.Tensor:
    per = codes_per_byte(bits)
    byte = torch.arange(256, dtype=torch.int32)[:, None]
    return ((byte >> (torch.arange(per, dtype=torch.int32) * bits)) & (2**bits - 1)).float().to(device)


def unpack_float(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """unpack(packed, bits).float() as a table lookup per byte (3x faster on CPU)."""
    if word_bytes(bits) > 1:
        codes = three_bit_codes_float(packed, -1)
        return codes.reshape(*codes.shape[:-2], codes.shape[-2] * 8)
    codes = F.embedding(packed.long(), _unpack_table(bits, str(packed.device)))
    return codes.reshape(*packed.shape[:-1], packed.shape[-1] * codes_per_byte(bits))


def quantize_pack_reference(x: torch.Tensor, bits: int, group_size: int, axis: str,
                            levels: torch.Tensor | None = None, exclude: torch.Tensor | None = None):
    """x [..., T, D] -> (codes [..., T, D*B/8] uint8, scale, zero). exclude (bool, x's shape): elements
    kept out of their group's min/max (sparse outliers); an all-excluded group gets scale 0, zero 0."""
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
    f = half_if_wide(scale).unsqueeze(dim)
    q = quantize_codes(g * f, scale.unsqueeze(dim) * f, zero.unsqueeze(dim) * f, bits, levels).reshape(*lead, T, D)
    return pack(q, bits), scale, zero


def expand_groups(t: torch.Tensor, group_size: int, axis: str, head_dim: int) -> torch.Tensor:
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
