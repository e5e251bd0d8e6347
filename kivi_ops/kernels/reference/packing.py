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

Packed layout (both axes): codes are packed along the channel (last) dimension into uint8
"words" of WB bytes holding P codes each, little end first:
    word[..., t, j] = sum_i q[..., t, j * P + i] << (i * B)           for i in [0, P)
    B = 2, 4, 8: WB = 1 byte, P = 8/B codes; the byte is the word.
    B = 3:       WB = 3 bytes, P = 8 codes (24 bits, no padding), stored plane-major: with
                 NW = D/8 words per token, byte [p * NW + j] = (word[j] >> 8p) & 255 (p = 0, 1, 2),
                 so each of the three planes is a contiguous run of NW bytes.
so codes have shape [..., T, D * B / 8]. Packing along channels for both axes gives keys and
values one layout: a token's row is contiguous, and the cache appends tokens as rows.

Why 8 codes per 3 bytes for B = 3 (docs/cache.md, "3-bit codes"): exactly 3 bits per code at every
head_dim that is a multiple of 8 (10 codes per int32 would spend 3.5 bits at D = 64 and 3.25 at
D = 128, and its 10 codes per word are not a power of two, which Triton tiles need); unpacking a
word is three byte loads (contiguous vectors, thanks to the planes), two shifts and two ors, then
one shift and one mask per code, the same per-code work as 2 and 4 bits.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def codes_per_word(bits: int) -> int:
    """Codes in one packed word (module doc): 8/B for B = 2, 4, 8; 8 for B = 3."""
    return 8 if bits == 3 else 8 // bits


def word_bytes(bits: int) -> int:
    """Bytes of one packed word: 3 for B = 3 (8 codes), else 1."""
    return 3 if bits == 3 else 1


def packed_bytes(head_dim: int, bits: int) -> int:
    """Bytes of one token's packed row of head_dim codes (head_dim a multiple of codes_per_word)."""
    return head_dim // codes_per_word(bits) * word_bytes(bits)


def codes_per_byte(bits: int) -> int:
    """Codes per byte of the one-byte-word widths (2, 4, 8); 3-bit words span 3 bytes (use
    codes_per_word / word_bytes / packed_bytes)."""
    if bits == 3:
        raise ValueError("3-bit codes pack 8 per 3 bytes, not a whole number per byte: use "
                         "codes_per_word(3) = 8 and word_bytes(3) = 3 (kivi_ops.kernels.reference.packing)")
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
    if torch.compiler.is_compiling():
        # Traced (compile, export): the same count of midpoints at or below each value, as a
        # comparison and a sum, core ATen ops (bucketize is not, and ExecuTorch refuses it).
        return (midpoints.to(normalized.device) <= normalized[..., None]).sum(-1)
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
    per = codes_per_word(bits)
    if per == 1:
        return q.contiguous()
    q = q.reshape(*q.shape[:-1], q.shape[-1] // per, per).to(torch.int32)
    # sum_i q_i << (i * bits) by Horner's rule with integer constants: exact, core ATen ops the
    # ONNX and ExecuTorch exporters take (shifts are not core ATen; ONNX lacks __lshift__), and
    # elementwise work Inductor fuses (a tensor of powers 2 ** arange would be an aten.pow call).
    packed = q[..., per - 1]
    for i in range(per - 2, -1, -1):
        packed = packed * 2**bits + q[..., i]
    if word_bytes(bits) == 1:
        return packed.to(torch.uint8)
    # 3-bit: 24-bit words split into three byte planes [..., 3, NW] (module doc), with division
    # and remainder (core ATen, exact on int32).
    planes = torch.stack([torch.remainder(packed, 256),
                          torch.remainder(torch.div(packed, 256, rounding_mode="floor"), 256),
                          torch.div(packed, 65536, rounding_mode="floor")], -2)
    return planes.reshape(*packed.shape[:-1], 3 * packed.shape[-1]).to(torch.uint8)


def unpack_words(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """packed uint8 [..., D * bits / 8] -> int32 words [..., D / codes_per_word(bits)] (module doc):
    the bytes themselves, or for 3 bits the three planes reassembled (sums of multiples: core ATen)."""
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
    """fp32 codes of 3-bit rows [..., 3 * NW] stacked at dim (-1: [..., NW, 8]; -2: [..., 8, NW]):
    the byte planes reassembled into 24-bit words in fp32 (exact) and code i = floor(w / 2^3i) -
    8 floor(w / 2^(3i+3)) (exact: powers of two). Core ATen, vectorizable float arithmetic."""
    nw = packed.shape[-1] // 3
    b = packed.float()
    w = b[..., :nw] + b[..., nw : 2 * nw] * 256.0 + b[..., 2 * nw :] * 65536.0
    return torch.stack([torch.floor(w * 2.0 ** (-3 * i)) - 8.0 * torch.floor(w * 2.0 ** (-3 * i - 3))
                        for i in range(8)], dim)


@functools.lru_cache(maxsize=None)
def _unpack_table(bits: int, device: str) -> torch.Tensor:
    """[256, 8/B] float32: the codes held by each possible byte (one-byte words)."""
    per = codes_per_byte(bits)
    byte = torch.arange(256, dtype=torch.int32)[:, None]
    return ((byte >> (torch.arange(per, dtype=torch.int32) * bits)) & (2**bits - 1)).float().to(device)


def unpack_float(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """unpack(packed, bits).float(), as one table lookup per byte (3x faster on CPU); 3-bit words
    (24 bits, no table) in fp32 arithmetic (three_bit_codes_float)."""
    if word_bytes(bits) > 1:
        codes = three_bit_codes_float(packed, -1)
        return codes.reshape(*codes.shape[:-2], codes.shape[-2] * 8)
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
