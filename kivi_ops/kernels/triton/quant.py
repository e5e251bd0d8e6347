"""Triton quantize-and-pack and unpack-and-dequantize, bit for bit reference/packing.py's numerics and layout,
and the jit helpers the cache kernels share. Divisions use tl.math.div_rn: a plain fp32 `/` lowers to
the approximate div.full.f32 on NVIDIA GPUs. Dequantization may contract to an FMA (<= 1 ulp)."""

from __future__ import annotations

import contextlib
import os

import torch
import triton
import triton.language as tl

from ..reference.packing import WIDE_SCALE, codes_per_word, token_group_size, word_bytes

_WIDE_SCALE = tl.constexpr(WIDE_SCALE)
_FP16_MAX = tl.constexpr(torch.finfo(torch.float16).max)
_BF16_MAX = tl.constexpr(torch.finfo(torch.bfloat16).max)
_FP32_MAX = tl.constexpr(torch.finfo(torch.float32).max)


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def device_ctx(t: torch.Tensor):
    """Launch on the tensor's device: Triton uses the current CUDA device."""
    if t.is_cuda:
        return torch.cuda.device(t.device)
    return contextlib.nullcontext()


def next_pow2(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


@triton.jit
def to_dtype_rtne(x, DTYPE: tl.constexpr):
    """fp32 -> DTYPE round-to-nearest-even; bf16 in integer ops, as the interpreter truncates its casts."""
    if DTYPE == tl.bfloat16:
        b = x.to(tl.uint32, bitcast=True)
        b = b + 0x7FFF + ((b >> 16) & 1)
        b = (b >> 16) << 16
        return b.to(tl.float32, bitcast=True).to(tl.bfloat16)
    else:
        return x.to(DTYPE)


@triton.jit
def saturate(x, DTYPE: tl.constexpr):
    """fp32 x clamped to DTYPE's finite range (packing.saturate); NaN stays NaN."""
    if DTYPE == tl.float16:
        return tl.where(x > _FP16_MAX, _FP16_MAX, tl.where(x < -_FP16_MAX, -_FP16_MAX, x))
    elif DTYPE == tl.bfloat16:
        return tl.where(x > _BF16_MAX, _BF16_MAX, tl.where(x < -_BF16_MAX, -_BF16_MAX, x))
    else:
        return tl.where(x > _FP32_MAX, _FP32_MAX, tl.where(x < -_FP32_MAX, -_FP32_MAX, x))


@triton.jit
def half_if_wide(scale):
    return tl.where(scale >= _WIDE_SCALE, 0.5, 1.0)


@triton.jit
def scale_zero_stored(mn, mx, MAXQ: tl.constexpr, DTYPE: tl.constexpr):
    """Stored scale and zero from fp32 min/max, as packing.minmax_scale_zero."""
    wide = (mx - mn) == float("inf")
    f = tl.where(wide, 0.5, 1.0)
    scale = tl.math.div_rn(mx * f - mn * f, tl.full(mn.shape, MAXQ, tl.float32)) * tl.where(wide, 2.0, 1.0)
    return to_dtype_rtne(scale, DTYPE), mn.to(DTYPE)


@triton.jit
def quant_codes(x, scale, zero, MAXQ: tl.constexpr):
    f = half_if_wide(scale)
    safe = tl.where(scale == 0.0, 1.0, scale * f)
    q = tl.floor(tl.math.div_rn(x * f - zero * f, safe) + 0.5)
    q = tl.minimum(tl.maximum(q, 0.0), MAXQ * 1.0)
    return q.to(tl.int32)


@triton.jit
def nuq_codes(x, scale, zero, levels, BITS: tl.constexpr):
    """Codes of the nearest nuq level, ties up (torch.bucketize(right=True) on the midpoints), by
    binary search: BITS gathers instead of 2^BITS - 1 comparisons."""
    f = half_if_wide(scale)
    safe = tl.where(scale == 0.0, 1.0, scale * f)
    xn = tl.math.div_rn(x * f - zero * f, safe)
    q = tl.zeros(xn.shape, tl.int32)
    for i in tl.static_range(BITS):
        cand = q + (1 << (BITS - 1 - i))
        mid = (tl.load(levels + cand - 1) + tl.load(levels + cand)) * 0.5
        q = tl.where(mid <= xn, cand, q)
    return q


@triton.jit
def pack_codes(q, BITS: tl.constexpr, PER: tl.constexpr):
    """int32 codes [..., PER] (a word's codes, little end first) -> int32 words [...]."""
    shifts = tl.arange(0, PER) * BITS
    return tl.sum(q << shifts, axis=len(q.shape) - 1)


@triton.jit
def unpack_codes(byte, BITS: tl.constexpr, PER: tl.constexpr):
    """words [N, NB] -> int32 codes [N, NB, PER]."""
    shifts = tl.arange(0, PER) * BITS
    return (byte.to(tl.int32)[:, :, None] >> shifts[None, None, :]) & ((1 << BITS) - 1)


@triton.jit
def load_words(ptrs, NW, BITS: tl.constexpr, mask):
    """int32 words at ptrs (row start + j): one byte, or at 3 bits three byte planes NW apart."""
    if mask is None:
        if BITS == 3:
            b0 = tl.load(ptrs).to(tl.int32)
            b1 = tl.load(ptrs + NW).to(tl.int32)
            b2 = tl.load(ptrs + 2 * NW).to(tl.int32)
            return b0 | (b1 << 8) | (b2 << 16)
        else:
            return tl.load(ptrs).to(tl.int32)
    else:
        if BITS == 3:
            b0 = tl.load(ptrs, mask=mask, other=0).to(tl.int32)
            b1 = tl.load(ptrs + NW, mask=mask, other=0).to(tl.int32)
            b2 = tl.load(ptrs + 2 * NW, mask=mask, other=0).to(tl.int32)
            return b0 | (b1 << 8) | (b2 << 16)
        else:
            return tl.load(ptrs, mask=mask, other=0).to(tl.int32)


@triton.jit
def store_words(ptrs, NW, BITS: tl.constexpr, words, mask):
    if BITS == 3:
        tl.store(ptrs, (words & 255).to(tl.uint8), mask=mask)
        tl.store(ptrs + NW, ((words >> 8) & 255).to(tl.uint8), mask=mask)
        tl.store(ptrs + 2 * NW, ((words >> 16) & 255).to(tl.uint8), mask=mask)
    else:
        tl.store(ptrs, words.to(tl.uint8), mask=mask)


@triton.jit
def _quantize_channel_kernel(
    x_ptr, codes_ptr, scale_ptr, zero_ptr,
    D, NB,
    BITS: tl.constexpr, PER: tl.constexpr, G: tl.constexpr, BLOCK_B: tl.constexpr,
):
    """Keys: one program per group of G rows x BLOCK_B bytes; x viewed as [rows, D]."""
    gi = tl.program_id(0).to(tl.int64)
    jb = tl.program_id(1) * BLOCK_B + tl.arange(0, BLOCK_B)
    ii = tl.arange(0, PER)
    rows = gi * G + tl.arange(0, G).to(tl.int64)
    ch = jb[:, None] * PER + ii[None, :]
    cmask = (jb < NB)[:, None] & (ii < PER)[None, :]
    x = tl.load(x_ptr + rows[:, None, None] * D + ch[None, :, :], mask=cmask[None, :, :], other=0.0)
    x = x.to(tl.float32)
    scale, zero = scale_zero_stored(tl.min(x, axis=0), tl.max(x, axis=0), (1 << BITS) - 1, scale_ptr.dtype.element_ty)
    tl.store(scale_ptr + gi * D + ch, scale, mask=cmask)
    tl.store(zero_ptr + gi * D + ch, zero, mask=cmask)
    q = quant_codes(x, scale.to(tl.float32)[None, :, :], zero.to(tl.float32)[None, :, :], (1 << BITS) - 1)
    packed = pack_codes(q, BITS, PER)
    store_words(codes_ptr + rows[:, None] * (NB * (PER * BITS // 8)) + jb[None, :], NB, BITS, packed,
                (jb < NB)[None, :])


@triton.jit
def _quantize_token_kernel(
    x_ptr, codes_ptr, scale_ptr, zero_ptr,
    n_rows, D, NB, NG,
    BITS: tl.constexpr, PER: tl.constexpr, GV: tl.constexpr, GB_P: tl.constexpr, BLOCK_T: tl.constexpr,
):
    """Values: one program per BLOCK_T rows, looping over the NG channel groups."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    rmask = rows < n_rows
    jb = tl.arange(0, GB_P)
    ii = tl.arange(0, PER)
    m = rmask[:, None, None] & (jb < GV // PER)[None, :, None] & (ii < PER)[None, None, :]
    for g in range(NG):
        ch = g * GV + jb[:, None] * PER + ii[None, :]
        x = tl.load(x_ptr + rows[:, None, None] * D + ch[None, :, :], mask=m, other=0.0).to(tl.float32)
        mn = tl.min(tl.min(tl.where(m, x, float("inf")), axis=2), axis=1)
        mx = tl.max(tl.max(tl.where(m, x, float("-inf")), axis=2), axis=1)
        mn = tl.where(rmask, mn, 0.0)  # rows past the end: keep the math finite
        mx = tl.where(rmask, mx, 0.0)
        scale, zero = scale_zero_stored(mn, mx, (1 << BITS) - 1, scale_ptr.dtype.element_ty)
        tl.store(scale_ptr + rows * NG + g, scale, mask=rmask)
        tl.store(zero_ptr + rows * NG + g, zero, mask=rmask)
        q = quant_codes(x, scale.to(tl.float32)[:, None, None], zero.to(tl.float32)[:, None, None], (1 << BITS) - 1)
        packed = pack_codes(q, BITS, PER)
        store_words(codes_ptr + rows[:, None] * (NB * (PER * BITS // 8)) + g * (GV // PER) + jb[None, :], NB, BITS,
                    packed,
                    rmask[:, None] & (jb < GV // PER)[None, :])


@triton.jit
def _dequantize_kernel(
    codes_ptr, scale_ptr, zero_ptr, out_ptr,
    n_rows, D, NB, NG,
    BITS: tl.constexpr, PER: tl.constexpr, CHANNEL: tl.constexpr, G: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_B: tl.constexpr,
):
    """One program per BLOCK_T rows x BLOCK_B bytes."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    jb = tl.program_id(1) * BLOCK_B + tl.arange(0, BLOCK_B)
    ii = tl.arange(0, PER)
    m2 = (rows < n_rows)[:, None] & (jb < NB)[None, :]
    m3 = m2[:, :, None] & (ii < PER)[None, None, :]
    byte = load_words(codes_ptr + rows[:, None] * (NB * (PER * BITS // 8)) + jb[None, :], NB, BITS, m2)
    q = unpack_codes(byte, BITS, PER)
    ch = (jb[:, None] * PER + ii[None, :])[None, :, :]
    if CHANNEL:
        soff = (rows // G)[:, None, None] * D + ch
    else:
        soff = rows[:, None, None] * NG + ch // G
    s = tl.load(scale_ptr + soff, mask=m3, other=0.0).to(tl.float32)
    z = tl.load(zero_ptr + soff, mask=m3, other=0.0).to(tl.float32)
    f = half_if_wide(s)
    x = (q.to(tl.float32) * (s * f) + z * f) * tl.where(f < 1.0, 2.0, 1.0)
    DT = out_ptr.dtype.element_ty
    tl.store(out_ptr + rows[:, None, None] * D + ch, to_dtype_rtne(saturate(x, DT), DT), mask=m3)


def _check_common(bits: int, group_size: int, axis: str) -> None:
    if bits not in (2, 3, 4, 8):
        raise ValueError(f"bits must be one of (2, 3, 4, 8), got {bits}")
    if group_size <= 0 or group_size & (group_size - 1):
        raise ValueError(f"group_size must be a power of two, got {group_size}")
    if axis not in ("channel", "token"):
        raise ValueError(f"axis must be 'channel' or 'token', got {axis!r}")


def quantize_pack_triton(x: torch.Tensor, bits: int, group_size: int, axis: str):
    """x [..., T, D] -> (codes uint8 [..., T, D*bits/8], scale, zero) like quantize_pack_reference."""
    _check_common(bits, group_size, axis)
    x = x.contiguous()
    *lead, T, D = x.shape
    per, wb = codes_per_word(bits), word_bytes(bits)
    if D % per:
        raise ValueError(f"D={D} must be a multiple of {per} for {bits}-bit packing")
    NB = D // per
    rows = x.numel() // D if D else 0
    codes = torch.empty((*lead, T, NB * wb), dtype=torch.uint8, device=x.device)
    if axis == "channel":
        if T % group_size:
            raise ValueError(f"T={T} must be a multiple of group_size={group_size} for axis='channel'")
        gshape = (*lead, T // group_size, D)
    else:
        gv = token_group_size(group_size, D)
        if D % gv or gv % per:
            raise ValueError(f"D={D} must be a multiple of group_size={gv}, itself a multiple of {per}, for axis='token'")
        gshape = (*lead, T, D // gv)
    scale = torch.empty(gshape, dtype=x.dtype, device=x.device)
    zero = torch.empty(gshape, dtype=x.dtype, device=x.device)
    if rows == 0:
        return codes, scale, zero
    with device_ctx(x):
        if axis == "channel":
            # About 2K elements a program (registers).
            block_b = max(1, min(next_pow2(NB), 2048 // (group_size * per)))
            grid = (rows // group_size, triton.cdiv(NB, block_b))
            torch.library.wrap_triton(_quantize_channel_kernel)[grid](
                x, codes, scale, zero, D, NB,
                BITS=bits, PER=per, G=group_size, BLOCK_B=block_b, num_warps=4,
            )
        else:
            gb_p = next_pow2(gv // per)
            block_t = max(1, min(64, 2048 // (gb_p * per)))
            grid = (triton.cdiv(rows, block_t),)
            torch.library.wrap_triton(_quantize_token_kernel)[grid](
                x, codes, scale, zero, rows, D, NB, D // gv,
                BITS=bits, PER=per, GV=gv, GB_P=gb_p, BLOCK_T=block_t, num_warps=4,
            )
    return codes, scale, zero


def unpack_dequantize_triton(codes, scale, zero, bits: int, group_size: int, axis: str) -> torch.Tensor:
    """Inverse of quantize_pack_triton: codes [..., T, NB] -> x' [..., T, NB*8/bits] in scale.dtype."""
    _check_common(bits, group_size, axis)
    codes, scale, zero = codes.contiguous(), scale.contiguous(), zero.contiguous()
    per, wb = codes_per_word(bits), word_bytes(bits)
    *lead, T, nbytes = codes.shape
    NB = nbytes // wb
    D = NB * per
    out = torch.empty((*lead, T, D), dtype=scale.dtype, device=codes.device)
    rows = codes.numel() // nbytes if nbytes else 0
    if rows == 0:
        return out
    if axis == "channel":
        g, ng = group_size, D
    else:
        g = token_group_size(group_size, D)
        ng = D // g
    block_b = min(next_pow2(NB), max(1, 256 // per))
    block_t = max(1, min(64, 4096 // (block_b * per)))
    grid = (triton.cdiv(rows, block_t), triton.cdiv(NB, block_b))
    with device_ctx(codes):
        torch.library.wrap_triton(_dequantize_kernel)[grid](
            codes, scale, zero, out, rows, D, NB, ng,
            BITS=bits, PER=per, CHANNEL=axis == "channel", G=g,
            BLOCK_T=block_t, BLOCK_B=block_b, num_warps=4,
        )
    return out
