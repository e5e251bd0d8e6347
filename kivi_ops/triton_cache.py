"""Triton kernels for the KIVI cache: append (streaming quantization) and fused split-K attention.

Cache layout and streaming policy: see cache_reference.py (the specification these kernels are
tested against). Both launchers are CUDA-graph safe: no host syncs, every grid is derived from
static shapes, and all data-dependent logic (how many tokens flush, which slots are live) is
predicated on `lengths`/`counts` inside the kernels.

cache_append_triton, four launches on the current stream (the order removes the read-before-write
hazards of the residual ring buffers):
  1. _append_key_flush_kernel   grid (B*H, max key groups flushed per call, D byte blocks):
     group i of the window [nqk, nqk_end) is read from k_res (tokens < L) or from `key`, quantized
     per channel and written to k_codes/k_scale/k_zero.
  2. _append_value_flush_kernel grid (B*H, cdiv(n, BLOCK_T)): values leaving the R-token window,
     tokens [max(L-R,0), max(L+c-R,0)), read from v_res (tokens < L) or `value`, quantized per token.
  3. _append_residual_kernel    grid (B*H, cdiv(n, BLOCK_T)): new tokens that stay full precision
     go to slot t % R of k_res / v_res (keys: t >= nqk_end; values: t >= L+c-R).
  4. _append_lengths_kernel     grid (1,): lengths += c.
  Launches 1-2 read residual slots that launch 3 overwrites; launch 4 changes what 1-3 read.
  Difference from the CPU reference: tokens past max_seq_len S are dropped (c = min(counts, n,
  S - L)) instead of raising, since a kernel cannot raise without a host sync; lengths then
  stops at S. Counts are also clamped to [0, n].

cache_attend_triton (flash decoding):
  1. _attend_split_kernel grid (B*H, cdiv(M, BLOCK_M), num_splits), M = (Hq/H) * q_len: one
     program owns every query row of one kv head (GQA without repeat_kv; row r = g*q_len + i is
     query i of head h*Hq/H + g; rows padded to BLOCK_M >= 16 for tl.dot) and one contiguous token
     range of its sequence. The range is cut at run time from the sequence's own length
     (split_len = cdiv(L, num_splits) rounded up to BLOCK_N), so the work is balanced whatever L is
     while the grid stays static; num_splits comes from static shapes only (attend_num_splits).
     Per BLOCK_N-token tile (_attend_tile) it unpacks the 2/4/8-bit codes in registers,
     dequantizes (keys: per channel, one scale row per G tokens; values: per token, scale column
     c // Gv), selects quantized vs residual per token (key quantized iff t < (L // R) * R, value
     iff t < L - R; residual slot t % R) and runs an online softmax (base 2, scale * log2(e)
     folded in). Tiles below min(nqk, nqv) take a path with no residual loads or selects; only
     the last <= R + BLOCK_N tokens take the mixed path. Partial (m, l, acc) go to a small fp32
     workspace; with num_splits == 1 the kernel normalizes and writes the output directly.
  2. _attend_reduce_kernel grid (B*H*M,): merges the splits of one row. Empty splits (m = -inf,
     l = 0) weigh 0; rows with no visible key (padding rows, empty sequences) return 0.
  With the full-precision token pool (pool=(pool_k, pool_v, pool_pos), pool.py; HAS_POOL, else the
  kernels compile exactly as without it): each program loads the P pooled positions of its kv head
  once and masks the cache tokens at those positions in every tile (a [BLOCK_N, P] comparison; P,
  sinks + outliers + spill, is small); split 0 then runs the P exact pool keys/values through the
  same online softmax in BLOCK_N-slot tiles (visible: filled slots at or before the query, real
  rows), so the reduce kernel merges them like any other split's tokens.
  KVQuant's options (extras.py; constexpr flags, off = the plain kernels, instruction for
  instruction): HAS_LEVELS, nuq levels: the append kernels quantize to the nearest level (binary
  search over the level midpoints, nuq_codes) and the attention kernels dequantize levels[code]
  (a gather from the 2^bits-entry table) before scale and zero. ROPE, keys stored pre-RoPE
  (rope_inv_freq [D/2]): every key, quantized, residual or pooled, is rotated to its position
  (cache row t, or pool_pos) with cos/sin computed in-kernel from t * inv_freq (a [S, D] table
  would read more bytes than the codes). The split kernel dequantizes keys as two D/2-channel
  halves, rotates them in fp32 (rotate-half is a mix of the two halves) and runs two tl.dot of
  D/2; the decode kernel rotates the query back per token instead (q . R_t k = (R_t^T q) . k),
  which needs no partner channel of the key tile, so its key scales no longer fold into the
  query. The sparse outlier store has no kernel (the ops run the decomposed form for it).
  Products use tl.dot: fp16/bf16 caches on tensor cores with the dequantized keys/values and the
  probabilities rounded to the cache dtype and fp32 accumulation (like fp16 flash attention);
  fp32 caches with F32_DOT_PRECISION ("tf32x3" by default, see there).
  The query is used in the cache dtype (cast if it differs); the output has the query's dtype.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import triton
import triton.language as tl

from .extras import NO_EXTRAS, Extras, check_extras
from .packing import codes_per_byte, token_group_size
from .triton_quant import (
    device_ctx, interpreting, next_pow2, nuq_codes, pack_codes, quant_codes, scale_zero_stored, to_dtype_rtne,
    unpack_codes,
)

LOG2E = 1.0 / math.log(2.0)
MAX_SPLITS = 64
# fp32 caches: tl.dot precision of the attention products. "tf32x3" (three TF32 tensor-core
# products, error ~2^-22 relative per product, i.e. fp32-accumulation class) instead of "ieee"
# (FMA loop: ~5x the FMAs for 3 real query rows padded to 16, and register spills at D=128).
# The interpreter ignores it (numpy fp32). Set to "ieee" for exact-fp32 products.
F32_DOT_PRECISION = "tf32x3"


# ---------------------------------------------------------------- append


@triton.jit
def _stored_and_appended(lengths_ptr, counts_ptr, b, N, S, HAS_COUNTS: tl.constexpr):
    """L: tokens sequence b stores; c: tokens it appends now, clamped to [0, n] and to the free room S - L."""
    L = tl.load(lengths_ptr + b).to(tl.int32)
    if HAS_COUNTS:
        c = tl.minimum(tl.load(counts_ptr + b).to(tl.int32), N)
    else:
        c = tl.zeros_like(L) + N
    c = tl.maximum(tl.minimum(c, S - L), 0)
    return L, c


@triton.jit
def _quantize(x, scale, zero, levels, BITS: tl.constexpr, HAS_LEVELS: tl.constexpr):
    """int32 codes of fp32 x (packing.quantize_codes): the uniform grid, or the nearest nuq level."""
    if HAS_LEVELS:
        return nuq_codes(x, scale, zero, levels, BITS)
    else:
        return quant_codes(x, scale, zero, (1 << BITS) - 1)


@triton.jit
def _append_key_flush_kernel(
    k_codes, k_scale, k_zero, k_res, key_ptr, lengths_ptr, counts_ptr, k_levels,
    s_kb, s_kh, s_kn, s_kd,
    H, N, S, NSG,
    HAS_COUNTS: tl.constexpr, HAS_LEVELS: tl.constexpr, D: tl.constexpr, NB: tl.constexpr, BITS: tl.constexpr,
    PER: tl.constexpr,
    G: tl.constexpr, R: tl.constexpr, RR: tl.constexpr, BLOCK_B: tl.constexpr,
):
    bh = tl.program_id(0)
    b = bh // H
    h = bh % H
    L, c = _stored_and_appended(lengths_ptr, counts_ptr, b, N, S, HAS_COUNTS)
    nqk = (L // R) * R
    nqk_end = ((L + c) // R) * R
    start = nqk + tl.program_id(1) * G
    if start < nqk_end:
        bh64 = bh.to(tl.int64)
        u = start + tl.arange(0, G)  # tokens of this group, all < nqk_end <= L + c
        jb = tl.program_id(2) * BLOCK_B + tl.arange(0, BLOCK_B)
        ii = tl.arange(0, PER)
        ch = (jb[:, None] * PER + ii[None, :])[None, :, :]  # [1, BLOCK_B, PER]
        cmask = ((jb < NB)[:, None] & (ii < PER)[None, :])[None, :, :]
        from_res = (u < L)[:, None, None]
        x_res = tl.load(k_res + (bh64 * RR + (u % R)[:, None, None]) * D + ch, mask=from_res & cmask, other=0.0)
        new_off = (b.to(tl.int64) * s_kb + h.to(tl.int64) * s_kh
                   + (u - L).to(tl.int64)[:, None, None] * s_kn + ch.to(tl.int64) * s_kd)
        x_new = tl.load(key_ptr + new_off, mask=(~from_res) & cmask, other=0.0)
        x = tl.where(from_res, x_res, x_new).to(tl.float32)
        scale, zero = scale_zero_stored(tl.min(x, axis=0), tl.max(x, axis=0), (1 << BITS) - 1,
                                        k_scale.dtype.element_ty)
        srow = (bh64 * NSG + start // G) * D
        tl.store(k_scale + srow + ch, scale[None, :, :], mask=cmask)
        tl.store(k_zero + srow + ch, zero[None, :, :], mask=cmask)
        q = _quantize(x, scale.to(tl.float32)[None, :, :], zero.to(tl.float32)[None, :, :], k_levels, BITS, HAS_LEVELS)
        packed = pack_codes(q, BITS, PER)  # [G, BLOCK_B]
        tl.store(k_codes + (bh64 * S + u[:, None]) * NB + jb[None, :], packed, mask=(jb < NB)[None, :])


@triton.jit
def _append_value_flush_kernel(
    v_codes, v_scale, v_zero, v_res, value_ptr, lengths_ptr, counts_ptr, v_levels,
    s_vb, s_vh, s_vn, s_vd,
    H, N, S,
    HAS_COUNTS: tl.constexpr, HAS_LEVELS: tl.constexpr, D: tl.constexpr, NB: tl.constexpr, NG: tl.constexpr,
    BITS: tl.constexpr,
    PER: tl.constexpr, GV: tl.constexpr, GB_P: tl.constexpr, R: tl.constexpr, RR: tl.constexpr, BLOCK_T: tl.constexpr,
):
    bh = tl.program_id(0)
    b = bh // H
    h = bh % H
    L, c = _stored_and_appended(lengths_ptr, counts_ptr, b, N, S, HAS_COUNTS)
    q0 = tl.maximum(L - R, 0)
    q1 = tl.maximum(L + c - R, 0)
    first = q0 + tl.program_id(1) * BLOCK_T
    if first < q1:
        bh64 = bh.to(tl.int64)
        u = first + tl.arange(0, BLOCK_T)
        active = u < q1
        from_res = (u < L)[:, None, None]
        jb = tl.arange(0, GB_P)
        ii = tl.arange(0, PER)
        m = active[:, None, None] & (jb < GV // PER)[None, :, None] & (ii < PER)[None, None, :]
        res_row = (bh64 * RR + (u % R)[:, None, None]) * D
        new_row = (b.to(tl.int64) * s_vb + h.to(tl.int64) * s_vh + (u - L).to(tl.int64)[:, None, None] * s_vn)
        for g in range(NG):
            ch = (g * GV + jb[:, None] * PER + ii[None, :])[None, :, :]
            x_res = tl.load(v_res + res_row + ch, mask=m & from_res, other=0.0)
            x_new = tl.load(value_ptr + new_row + ch.to(tl.int64) * s_vd, mask=m & (~from_res), other=0.0)
            x = tl.where(from_res, x_res, x_new).to(tl.float32)
            mn = tl.min(tl.min(tl.where(m, x, float("inf")), axis=2), axis=1)
            mx = tl.max(tl.max(tl.where(m, x, float("-inf")), axis=2), axis=1)
            mn = tl.where(active, mn, 0.0)
            mx = tl.where(active, mx, 0.0)
            scale, zero = scale_zero_stored(mn, mx, (1 << BITS) - 1, v_scale.dtype.element_ty)
            srow = (bh64 * S + u) * NG + g
            tl.store(v_scale + srow, scale, mask=active)
            tl.store(v_zero + srow, zero, mask=active)
            q = _quantize(x, scale.to(tl.float32)[:, None, None], zero.to(tl.float32)[:, None, None], v_levels,
                          BITS, HAS_LEVELS)
            packed = pack_codes(q, BITS, PER)  # [BLOCK_T, GB_P]
            tl.store(v_codes + (bh64 * S + u[:, None]) * NB + g * (GV // PER) + jb[None, :], packed,
                     mask=active[:, None] & (jb < GV // PER)[None, :])


@triton.jit
def _append_residual_kernel(
    k_res, v_res, key_ptr, value_ptr, lengths_ptr, counts_ptr,
    s_kb, s_kh, s_kn, s_kd, s_vb, s_vh, s_vn, s_vd,
    H, N, S,
    HAS_COUNTS: tl.constexpr, D: tl.constexpr, D_P: tl.constexpr, R: tl.constexpr, RR: tl.constexpr, BLOCK_T: tl.constexpr,
):
    bh = tl.program_id(0)
    b = bh // H
    h = bh % H
    L, c = _stored_and_appended(lengths_ptr, counts_ptr, b, N, S, HAS_COUNTS)
    end = L + c
    i = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    u = L + i
    valid = i < c
    d = tl.arange(0, D_P)
    dmask = (d < D)[None, :]
    slot = (bh.to(tl.int64) * RR + (u % R)[:, None]) * D + d[None, :]
    i64 = i.to(tl.int64)[:, None]
    d64 = d.to(tl.int64)[None, :]
    k_keep = (valid & (u >= (end // R) * R))[:, None] & dmask
    v_keep = (valid & (u >= end - R))[:, None] & dmask
    xk = tl.load(key_ptr + b.to(tl.int64) * s_kb + h.to(tl.int64) * s_kh + i64 * s_kn + d64 * s_kd, mask=k_keep)
    tl.store(k_res + slot, xk, mask=k_keep)
    xv = tl.load(value_ptr + b.to(tl.int64) * s_vb + h.to(tl.int64) * s_vh + i64 * s_vn + d64 * s_vd, mask=v_keep)
    tl.store(v_res + slot, xv, mask=v_keep)


@triton.jit
def _append_lengths_kernel(lengths_ptr, counts_ptr, B, N, S, HAS_COUNTS: tl.constexpr, BLOCK: tl.constexpr):
    for b0 in range(0, B, BLOCK):
        b = b0 + tl.arange(0, BLOCK)
        bm = b < B
        L = tl.load(lengths_ptr + b, mask=bm, other=0)
        if HAS_COUNTS:
            c = tl.minimum(tl.load(counts_ptr + b, mask=bm, other=0).to(L.dtype), N)
        else:
            c = tl.zeros_like(L) + N
        c = tl.maximum(tl.minimum(c, S - L), 0)
        tl.store(lengths_ptr + b, L + c, mask=bm)


def _check_cache(k_codes, k_scale, k_zero, k_res, v_codes, v_scale, v_zero, v_res, lengths,
                 k_bits, v_bits, group_size, residual_length):
    for name, t in (("k_codes", k_codes), ("k_scale", k_scale), ("k_zero", k_zero), ("k_res", k_res),
                    ("v_codes", v_codes), ("v_scale", v_scale), ("v_zero", v_zero), ("v_res", v_res),
                    ("lengths", lengths)):
        if not t.is_contiguous():
            raise ValueError(f"cache buffer {name} must be contiguous (a whole registered buffer)")
    B, H, S, _ = k_codes.shape
    R, G = residual_length, group_size
    D = k_res.shape[-1]
    if R % G:
        raise ValueError(f"residual_length={R} must be a multiple of group_size={G}")
    if k_codes.shape[-1] * codes_per_byte(k_bits) != D or v_codes.shape[-1] * codes_per_byte(v_bits) != D:
        raise ValueError("k_codes/v_codes last dim does not match head_dim at the given bits")
    # Residual slot of token t is t % R < S, so a cache shorter than R holds only S residual rows.
    RR = min(R, S)
    if tuple(k_res.shape) != (B, H, RR, D) or tuple(v_res.shape) != (B, H, RR, D):
        raise ValueError(f"k_res/v_res must have shape {(B, H, RR, D)}")
    gv = token_group_size(G, D)
    if D % gv or tuple(v_scale.shape) != (B, H, S, D // gv):
        raise ValueError(f"v_scale must have shape {(B, H, S, D // gv)}")
    if tuple(k_scale.shape) != (B, H, -(-S // G), D):
        raise ValueError(f"k_scale must have shape {(B, H, -(-S // G), D)}")
    return B, H, S, D, R, RR, G, gv


def _check_kernel_extras(extras: Extras, k_codes, k_res, k_bits, v_bits, residual_length) -> Extras:
    """The extras the kernels take (nuq levels, rope_inv_freq), checked and made contiguous; the
    sparse outlier store has no kernel (the ops run the decomposed form for it)."""
    if extras.sparse:
        raise ValueError("the Triton cache kernels do not take the dense-and-sparse outlier store")
    check_extras(extras, k_codes, k_res, k_bits, v_bits, residual_length)
    return Extras(*(None if t is None else t.contiguous() for t in extras))


def cache_append_triton(
    k_codes, k_scale, k_zero, k_res, v_codes, v_scale, v_zero, v_res, lengths,
    key, value, counts, k_bits, v_bits, group_size, residual_length, extras: Extras = NO_EXTRAS,
) -> None:
    """Append key/value [B, H, n, D] in place, like cache_append_reference (see module doc).
    extras: nuq levels (k_levels, v_levels) or none; rope_inv_freq plays no part in appends."""
    B, H, S, D, R, RR, G, gv = _check_cache(k_codes, k_scale, k_zero, k_res, v_codes, v_scale, v_zero, v_res,
                                        lengths, k_bits, v_bits, group_size, residual_length)
    extras = _check_kernel_extras(extras, k_codes, k_res, k_bits, v_bits, residual_length)
    has_levels = extras.k_levels is not None
    # Dummy pointers when absent (never read: HAS_LEVELS=False compiles the uniform grid only).
    k_levels = extras.k_levels if has_levels else k_scale
    v_levels = extras.v_levels if has_levels else v_scale
    n = key.shape[2]
    if tuple(key.shape) != (B, H, n, D) or tuple(value.shape) != (B, H, n, D):
        raise ValueError(f"key/value must have shape {(B, H, 'n', D)}, got {tuple(key.shape)}, {tuple(value.shape)}")
    if B == 0 or H == 0 or n == 0:
        return
    # The cache stores the new tokens in its own dtype (the reference's slice assignment casts too).
    if key.dtype != k_res.dtype:
        key = key.to(k_res.dtype)
    if value.dtype != v_res.dtype:
        value = value.to(v_res.dtype)
    has_counts = counts is not None
    cnt = counts if has_counts else lengths  # dummy pointer when absent (never read)
    kper, vper = codes_per_byte(k_bits), codes_per_byte(v_bits)
    nbk, nbv = D // kper, D // vper
    nsg = k_scale.shape[2]
    # Most key groups one call can flush: the window [nqk, nqk_end) is at most ((R-1+n)//R)*R long.
    key_groups = ((R - 1 + n) // R) * R // G
    block_b = max(1, min(next_pow2(nbk), 2048 // (G * kper)))
    gb_p = next_pow2(gv // vper)
    block_tv = max(1, min(32, next_pow2(n), 2048 // (gb_p * vper)))
    d_p = next_pow2(D)
    block_tr = max(1, min(32, next_pow2(n), 4096 // d_p))
    wrap = torch.library.wrap_triton
    with device_ctx(k_codes):
        wrap(_append_key_flush_kernel)[(B * H, key_groups, triton.cdiv(nbk, block_b))](
            k_codes, k_scale, k_zero, k_res, key, lengths, cnt, k_levels,
            key.stride(0), key.stride(1), key.stride(2), key.stride(3),
            H, n, S, nsg,
            HAS_COUNTS=has_counts, HAS_LEVELS=has_levels, D=D, NB=nbk, BITS=k_bits, PER=kper, G=G, R=R, RR=RR,
            BLOCK_B=block_b, num_warps=4,
        )
        wrap(_append_value_flush_kernel)[(B * H, triton.cdiv(n, block_tv))](
            v_codes, v_scale, v_zero, v_res, value, lengths, cnt, v_levels,
            value.stride(0), value.stride(1), value.stride(2), value.stride(3),
            H, n, S,
            HAS_COUNTS=has_counts, HAS_LEVELS=has_levels, D=D, NB=nbv, NG=D // gv, BITS=v_bits, PER=vper, GV=gv,
            GB_P=gb_p, R=R, RR=RR,
            BLOCK_T=block_tv, num_warps=4,
        )
        wrap(_append_residual_kernel)[(B * H, triton.cdiv(n, block_tr))](
            k_res, v_res, key, value, lengths, cnt,
            key.stride(0), key.stride(1), key.stride(2), key.stride(3),
            value.stride(0), value.stride(1), value.stride(2), value.stride(3),
            H, n, S,
            HAS_COUNTS=has_counts, D=D, D_P=d_p, R=R, RR=RR, BLOCK_T=block_tr, num_warps=4,
        )
        wrap(_append_lengths_kernel)[(1,)](
            lengths, cnt, B, n, S, HAS_COUNTS=has_counts, BLOCK=min(1024, next_pow2(B)), num_warps=1,
        )


# ---------------------------------------------------------------- attention


@triton.jit
def _cast(x, DTYPE: tl.constexpr, EMULATE_RTNE: tl.constexpr):
    """fp32 -> DTYPE; the native cast on GPU, the exact RTNE emulation under the interpreter."""
    if EMULATE_RTNE:
        return to_dtype_rtne(x, DTYPE)
    else:
        return x.to(DTYPE)


@triton.jit
def _in_pool(t, pp):
    """[T] bool: token t[i] is one of this (sequence, kv head)'s pooled positions pp [P_P]
    (-1 marks an empty slot and never matches). P is small (sinks + outliers + spill)."""
    return tl.max((t[:, None] == pp[None, :]).to(tl.int32), axis=1) > 0


@triton.jit
def _load_pool_positions(pool_pos, bh64, P, P_P: tl.constexpr, HAS_POOL: tl.constexpr):
    """Pooled positions [P_P] of kv head bh64 (int32, -1 = empty), loaded once per program; all -1
    without a pool (then a dead value: the tiles never read it)."""
    pp = tl.full([P_P], -1, tl.int32)
    if HAS_POOL:
        j = tl.arange(0, P_P)
        pp = tl.load(pool_pos + bh64 * P + j, mask=j < P, other=-1).to(tl.int32)
    return pp


@triton.jit
def _qk_dot(q, k, DOT_F32: tl.constexpr, F32_PRECISION: tl.constexpr):
    """Scores q [BLOCK_M, D_P] . k [T, D_P]^T, fp32 accumulation."""
    if DOT_F32:
        s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision=F32_PRECISION)
    else:
        s = tl.dot(q, tl.trans(k))
    return s


@triton.jit
def _softmax_step(s, visible, m_i, l_i, qk_scale):
    """Online softmax over raw scores s [BLOCK_M, T] (base 2; scale * log2(e) folded into qk_scale),
    invisible entries masked: (probabilities, rescale of the old accumulator, new max, new sum)."""
    s = tl.where(visible, s * qk_scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # fully masked rows stay NaN-free
    p = tl.math.exp2(s - m_safe[:, None])
    alpha = tl.math.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    return p, alpha, m_new, l_i


@triton.jit
def _accumulate_pv(acc, alpha, p, v, DT: tl.constexpr, LOWP: tl.constexpr, DOT_F32: tl.constexpr,
                   F32_PRECISION: tl.constexpr, EMULATE_RTNE: tl.constexpr):
    """acc * alpha + p @ v; low-precision caches round p to the cache dtype first (tensor cores)."""
    if LOWP:
        p = _cast(p, DT, EMULATE_RTNE)
    if DOT_F32:
        pv = tl.dot(p.to(tl.float32), v.to(tl.float32), input_precision=F32_PRECISION)
    else:
        pv = tl.dot(p, v)
    return acc * alpha[:, None] + pv


@triton.jit
def _code_values(codes, levels, HAS_LEVELS: tl.constexpr):
    """fp32 values of int32 codes before scale and zero (packing.code_values): the codes, or levels[code]
    (a gather from the 2^bits-entry table, which stays in L1)."""
    if HAS_LEVELS:
        return tl.load(levels + codes)
    else:
        return codes.to(tl.float32)


@triton.jit
def _rope_cos_sin(positions, freq):
    """cos and sin of the RoPE angles positions * freq (broadcast), the angle an fp32 product like
    rope.rope_at's. tl.cos / tl.sin lower to libdevice's __nv_cosf / __nv_sinf (full range
    reduction, not the approximate cos.approx.f32), numpy's under the interpreter."""
    angle = positions.to(tl.float32) * freq
    return tl.cos(angle), tl.sin(angle)


@triton.jit
def _rope_qk(q_lo, q_hi, k_lo, k_hi, positions, freq, DT: tl.constexpr, LOWP: tl.constexpr, DOT_F32: tl.constexpr,
             F32_PRECISION: tl.constexpr, EMULATE_RTNE: tl.constexpr):
    """Scores of pre-RoPE keys: the query halves q_lo, q_hi [BLOCK_M, HD_P] (channels [0, D/2) and
    [D/2, D)) against fp32 key halves k_lo, k_hi [T, HD_P] rotated to their positions [T] first
    (rotate-half: lo' = lo cos - hi sin, hi' = hi cos + lo sin, freq [HD_P] shared by both halves).
    Working in halves needs no channel shuffle and keeps the products two tl.dot of D/2 each.
    Low-precision caches round the rotated keys to the cache dtype (tensor cores)."""
    cos, sin = _rope_cos_sin(positions[:, None], freq[None, :])
    lo = k_lo * cos - k_hi * sin
    hi = k_hi * cos + k_lo * sin
    if LOWP:
        lo = _cast(lo, DT, EMULATE_RTNE)
        hi = _cast(hi, DT, EMULATE_RTNE)
    return _qk_dot(q_lo, lo, DOT_F32, F32_PRECISION) + _qk_dot(q_hi, hi, DOT_F32, F32_PRECISION)


@triton.jit
def _key_tile(
    t, tm, t0, limit, nqk, row, bh64, NSG, k_codes, k_scale, k_zero, k_res, k_levels,
    C0: tl.constexpr, W: tl.constexpr, W_P: tl.constexpr, MIXED: tl.constexpr, HAS_LEVELS: tl.constexpr,
    CAST: tl.constexpr, D: tl.constexpr, K_BITS: tl.constexpr, K_PER: tl.constexpr, G: tl.constexpr,
    NGB: tl.constexpr, R: tl.constexpr, RR: tl.constexpr, BLOCK_N: tl.constexpr, EMULATE_RTNE: tl.constexpr,
):
    """Keys [BLOCK_N, W_P] of tokens t, channels [C0, C0 + W) (the whole head, or one RoPE half):
    per-channel groups of G tokens, one scale row per group; fp32, or rounded to the cache dtype
    when CAST. MIXED: per-token choice between the dequantized codes and the residual ring."""
    c = tl.arange(0, W_P)
    cmask = c < W
    if MIXED:
        kq = tm & (t < nqk)
    else:
        kq = tm
    jk = tl.arange(0, W_P // K_PER)
    kb = tl.load(k_codes + row[:, None] * (D // K_PER) + (C0 // K_PER + jk)[None, :],
                 mask=kq[:, None] & (jk < W // K_PER)[None, :], other=0)
    kc = _code_values(tl.reshape(unpack_codes(kb, K_BITS, K_PER), [BLOCK_N, W_P]), k_levels, HAS_LEVELS)
    grow = t0 // G + tl.arange(0, NGB)  # the NGB scale rows this tile touches
    gm = ((grow * G < limit) & (grow * G < nqk))[:, None] & cmask[None, :]
    ks_off = (bh64 * NSG + grow)[:, None] * D + (C0 + c)[None, :]
    ks = tl.load(k_scale + ks_off, mask=gm, other=0.0).to(tl.float32)
    kz = tl.load(k_zero + ks_off, mask=gm, other=0.0).to(tl.float32)
    if NGB > 1:
        ks = tl.reshape(tl.broadcast_to(ks[:, None, :], [NGB, BLOCK_N // NGB, W_P]), [BLOCK_N, W_P])
        kz = tl.reshape(tl.broadcast_to(kz[:, None, :], [NGB, BLOCK_N // NGB, W_P]), [BLOCK_N, W_P])
    kdq = kc * ks + kz
    if CAST:
        kdq = _cast(kdq, k_res.dtype.element_ty, EMULATE_RTNE)
    if MIXED:
        slot = (bh64 * RR + (t % R)[:, None]) * D + (C0 + c)[None, :]
        kres = tl.load(k_res + slot, mask=(tm & (t >= nqk))[:, None] & cmask[None, :], other=0.0)
        k = tl.where(kq[:, None], kdq, kres.to(kdq.dtype))
    else:
        k = kdq
    return k


@triton.jit
def _attend_tile(
    acc, m_i, l_i, q, q_hi, freq, t0, limit, nqk, nqv, pos, row_ok, pp, bh64, S, NSG, qk_scale,
    k_codes, k_scale, k_zero, k_res, v_codes, v_scale, v_zero, v_res, k_levels, v_levels,
    MIXED: tl.constexpr, HAS_POOL: tl.constexpr, HAS_LEVELS: tl.constexpr, ROPE: tl.constexpr,
    D: tl.constexpr, D_P: tl.constexpr, HD: tl.constexpr, HD_P: tl.constexpr,
    K_BITS: tl.constexpr, K_PER: tl.constexpr, V_BITS: tl.constexpr, V_PER: tl.constexpr,
    G: tl.constexpr, NGB: tl.constexpr, NGV: tl.constexpr, NGV_P: tl.constexpr, GV_P: tl.constexpr,
    R: tl.constexpr, RR: tl.constexpr, BLOCK_N: tl.constexpr,
    LOWP: tl.constexpr, DOT_F32: tl.constexpr, F32_PRECISION: tl.constexpr, EMULATE_RTNE: tl.constexpr,
):
    """One online-softmax step over tokens [t0, t0 + BLOCK_N) (t0 a multiple of BLOCK_N), tokens
    >= limit masked. MIXED=False: every token is quantized for keys and values (no residual loads);
    MIXED=True: per-token choice between the dequantized codes and the residual ring. HAS_POOL:
    tokens at the pooled positions pp are masked (their exact copies come in _attend_pool_tile).
    HAS_LEVELS: codes stand for nuq levels. ROPE: keys are pre-RoPE; q / q_hi are then the query's
    halves and keys are dequantized as halves, rotated to their positions t (freq: inv_freq
    [HD_P]) in fp32 and only then rounded for the products; otherwise q is the whole query."""
    DT = k_res.dtype.element_ty
    t = t0 + tl.arange(0, BLOCK_N)
    tm = t < limit
    d = tl.arange(0, D_P)
    dmask = d < D
    row = bh64 * S + t  # int64 token row of codes and value scales

    # ---- keys [BLOCK_N, D_P]
    if ROPE:
        k_lo = _key_tile(t, tm, t0, limit, nqk, row, bh64, NSG, k_codes, k_scale, k_zero, k_res, k_levels,
                         0, HD, HD_P, MIXED, HAS_LEVELS, False, D, K_BITS, K_PER, G, NGB, R, RR, BLOCK_N, EMULATE_RTNE)
        k_hi = _key_tile(t, tm, t0, limit, nqk, row, bh64, NSG, k_codes, k_scale, k_zero, k_res, k_levels,
                         HD, HD, HD_P, MIXED, HAS_LEVELS, False, D, K_BITS, K_PER, G, NGB, R, RR, BLOCK_N, EMULATE_RTNE)
        s = _rope_qk(q, q_hi, k_lo, k_hi, t, freq, DT, LOWP, DOT_F32, F32_PRECISION, EMULATE_RTNE)
    else:
        k = _key_tile(t, tm, t0, limit, nqk, row, bh64, NSG, k_codes, k_scale, k_zero, k_res, k_levels,
                      0, D, D_P, MIXED, HAS_LEVELS, LOWP, D, K_BITS, K_PER, G, NGB, R, RR, BLOCK_N, EMULATE_RTNE)
        s = _qk_dot(q, k, DOT_F32, F32_PRECISION)

    visible = row_ok[:, None] & tm[None, :] & (t[None, :] <= pos[:, None])
    if HAS_POOL:
        visible = visible & ~_in_pool(t, pp)[None, :]
    p, alpha, m_new, l_i = _softmax_step(s, visible, m_i, l_i, qk_scale)

    # ---- values [BLOCK_N, D_P]: per-token groups of GV channels
    if MIXED:
        vq = tm & (t < nqv)
    else:
        vq = tm
    jv = tl.arange(0, D_P // V_PER)
    vb = tl.load(v_codes + row[:, None] * (D // V_PER) + jv[None, :],
                 mask=vq[:, None] & (jv < D // V_PER)[None, :], other=0)
    vc = _code_values(tl.reshape(unpack_codes(vb, V_BITS, V_PER), [BLOCK_N, D_P]), v_levels, HAS_LEVELS)
    if NGV == 1:
        vs = tl.load(v_scale + row, mask=vq, other=0.0).to(tl.float32)[:, None]
        vz = tl.load(v_zero + row, mask=vq, other=0.0).to(tl.float32)[:, None]
    else:
        gi = tl.arange(0, NGV_P)
        vs_off = row[:, None] * NGV + gi[None, :]
        vm = vq[:, None] & (gi < NGV)[None, :]
        vs = tl.load(v_scale + vs_off, mask=vm, other=0.0).to(tl.float32)
        vz = tl.load(v_zero + vs_off, mask=vm, other=0.0).to(tl.float32)
        vs = tl.reshape(tl.broadcast_to(vs[:, :, None], [BLOCK_N, NGV_P, GV_P]), [BLOCK_N, D_P])
        vz = tl.reshape(tl.broadcast_to(vz[:, :, None], [BLOCK_N, NGV_P, GV_P]), [BLOCK_N, D_P])
    vdq = vc * vs + vz
    if LOWP:
        vdq = _cast(vdq, DT, EMULATE_RTNE)
    if MIXED:
        slot = (bh64 * RR + (t % R)[:, None]) * D + d[None, :]
        vres = tl.load(v_res + slot, mask=(tm & (t >= nqv))[:, None] & dmask[None, :], other=0.0)
        v = tl.where(vq[:, None], vdq, vres.to(vdq.dtype))
    else:
        v = vdq
    acc = _accumulate_pv(acc, alpha, p, v, DT, LOWP, DOT_F32, F32_PRECISION, EMULATE_RTNE)
    return acc, m_new, l_i


@triton.jit
def _attend_pool_tile(
    acc, m_i, l_i, q, q_hi, freq, j0, pos, row_ok, bh64, P, qk_scale, pool_k, pool_v, pool_pos,
    ROPE: tl.constexpr, D: tl.constexpr, D_P: tl.constexpr, HD: tl.constexpr, HD_P: tl.constexpr,
    BLOCK_N: tl.constexpr, LOWP: tl.constexpr, DOT_F32: tl.constexpr, F32_PRECISION: tl.constexpr,
    EMULATE_RTNE: tl.constexpr,
):
    """One online-softmax step over pool slots [j0, j0 + BLOCK_N): exact keys/values (cache dtype),
    each visible to the real query rows at or after its token's position; empty slots (-1) to none.
    ROPE: pre-RoPE pool keys, rotated to their pool_pos (q, q_hi the query halves, _attend_tile)."""
    j = j0 + tl.arange(0, BLOCK_N)
    jm = j < P
    ppos = tl.load(pool_pos + bh64 * P + j, mask=jm, other=-1)
    d = tl.arange(0, D_P)
    off = (bh64 * P + j)[:, None] * D + d[None, :]
    m2 = jm[:, None] & (d < D)[None, :]
    if ROPE:
        c = tl.arange(0, HD_P)
        half = (bh64 * P + j)[:, None] * D + c[None, :]
        hm = jm[:, None] & (c < HD)[None, :]
        k_lo = tl.load(pool_k + half, mask=hm, other=0.0).to(tl.float32)
        k_hi = tl.load(pool_k + half + HD, mask=hm, other=0.0).to(tl.float32)
        s = _rope_qk(q, q_hi, k_lo, k_hi, ppos, freq, pool_k.dtype.element_ty, LOWP, DOT_F32, F32_PRECISION,
                     EMULATE_RTNE)
    else:
        k = tl.load(pool_k + off, mask=m2, other=0.0)
        s = _qk_dot(q, k, DOT_F32, F32_PRECISION)
    visible = row_ok[:, None] & (ppos >= 0)[None, :] & (ppos[None, :] <= pos[:, None])
    p, alpha, m_new, l_i = _softmax_step(s, visible, m_i, l_i, qk_scale)
    v = tl.load(pool_v + off, mask=m2, other=0.0)
    acc = _accumulate_pv(acc, alpha, p, v, pool_v.dtype.element_ty, LOWP, DOT_F32, F32_PRECISION, EMULATE_RTNE)
    return acc, m_new, l_i


@triton.jit
def _attend_split_kernel(
    q_ptr, s_qb, s_qh, s_qm, s_qd,
    k_codes, k_scale, k_zero, k_res, v_codes, v_scale, v_zero, v_res, lengths_ptr, counts_ptr,
    pool_k, pool_v, pool_pos, k_levels, v_levels, rope_inv_freq, ws_m, ws_l, ws_acc, out_ptr,
    H, S, NSG, Q_LEN, M, M_PAD, P, qk_scale,
    HAS_COUNTS: tl.constexpr, HAS_POOL: tl.constexpr, P_P: tl.constexpr, HAS_LEVELS: tl.constexpr,
    ROPE: tl.constexpr, QG: tl.constexpr, D: tl.constexpr, D_P: tl.constexpr, HD: tl.constexpr, HD_P: tl.constexpr,
    K_BITS: tl.constexpr, K_PER: tl.constexpr, V_BITS: tl.constexpr, V_PER: tl.constexpr,
    G: tl.constexpr, NGB: tl.constexpr, NGV: tl.constexpr, NGV_P: tl.constexpr, GV_P: tl.constexpr,
    R: tl.constexpr, RR: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
    LOWP: tl.constexpr, DOT_F32: tl.constexpr, F32_PRECISION: tl.constexpr, EMULATE_RTNE: tl.constexpr,
):
    bh = tl.program_id(0)
    sp = tl.program_id(2)
    b = bh // H
    h = bh % H
    bh64 = bh.to(tl.int64)
    L = tl.load(lengths_ptr + b).to(tl.int32)
    if HAS_COUNTS:
        c = tl.load(counts_ptr + b).to(tl.int32)
    else:
        c = tl.zeros_like(L) + Q_LEN
    nqk = (L // R) * R
    nqv = tl.maximum(L - R, 0)

    # Query rows of this kv head: r = g * Q_LEN + i -> head h*QG + g, query i at position L - c + i.
    r = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = r < M
    gq = r // Q_LEN
    iq = r % Q_LEN
    pos = L - c + iq
    row_ok = rmask & (iq < c)
    d = tl.arange(0, D_P)
    dmask = d < D
    q_row = b.to(tl.int64) * s_qb + (h * QG + gq).to(tl.int64)[:, None] * s_qh + iq.to(tl.int64)[:, None] * s_qm
    q_dt = tl.float32 if DOT_F32 else k_res.dtype.element_ty
    if ROPE:
        # Pre-RoPE keys are rotated in halves (_rope_qk): the query as its two halves too, and the
        # frequencies once per program.
        c = tl.arange(0, HD_P)
        hm = rmask[:, None] & (c < HD)[None, :]
        q = tl.load(q_ptr + q_row + c.to(tl.int64)[None, :] * s_qd, mask=hm, other=0.0).to(q_dt)
        q_hi = tl.load(q_ptr + q_row + (HD + c).to(tl.int64)[None, :] * s_qd, mask=hm, other=0.0).to(q_dt)
        freq = tl.load(rope_inv_freq + c, mask=c < HD, other=0.0)
    else:
        q = tl.load(q_ptr + q_row + d.to(tl.int64)[None, :] * s_qd, mask=rmask[:, None] & dmask[None, :],
                    other=0.0).to(q_dt)
        q_hi = q  # unused
        freq = tl.zeros([HD_P], tl.float32)  # unused

    # This split's token range, cut from the sequence's own length (balanced for any L) in
    # whole BLOCK_N tiles, so every tile starts at a multiple of BLOCK_N.
    split_len = tl.cdiv(tl.cdiv(L, NUM_SPLITS), BLOCK_N) * BLOCK_N
    lo = sp * split_len
    hi = tl.minimum(lo + split_len, L)
    # Tiles below `mid` are quantized for keys and values alike (the long, hot part); the last
    # <= R + BLOCK_N tokens go through the mixed path that also reads the residual rings.
    mid = tl.maximum(tl.minimum((tl.minimum(nqk, nqv) // BLOCK_N) * BLOCK_N, hi), lo)

    pp = _load_pool_positions(pool_pos, bh64, P, P_P, HAS_POOL)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_P], tl.float32)
    for t0 in range(lo, mid, BLOCK_N):
        acc, m_i, l_i = _attend_tile(
            acc, m_i, l_i, q, q_hi, freq, t0, mid, nqk, nqv, pos, row_ok, pp, bh64, S, NSG, qk_scale,
            k_codes, k_scale, k_zero, k_res, v_codes, v_scale, v_zero, v_res, k_levels, v_levels,
            False, HAS_POOL, HAS_LEVELS, ROPE, D, D_P, HD, HD_P, K_BITS, K_PER, V_BITS, V_PER,
            G, NGB, NGV, NGV_P, GV_P, R, RR, BLOCK_N, LOWP, DOT_F32, F32_PRECISION, EMULATE_RTNE,
        )
    for t0 in range(mid, hi, BLOCK_N):
        acc, m_i, l_i = _attend_tile(
            acc, m_i, l_i, q, q_hi, freq, t0, hi, nqk, nqv, pos, row_ok, pp, bh64, S, NSG, qk_scale,
            k_codes, k_scale, k_zero, k_res, v_codes, v_scale, v_zero, v_res, k_levels, v_levels,
            True, HAS_POOL, HAS_LEVELS, ROPE, D, D_P, HD, HD_P, K_BITS, K_PER, V_BITS, V_PER,
            G, NGB, NGV, NGV_P, GV_P, R, RR, BLOCK_N, LOWP, DOT_F32, F32_PRECISION, EMULATE_RTNE,
        )
    if HAS_POOL:
        # Split 0 also takes the pool's exact tokens; the reduce kernel merges them like any split.
        for j0 in range(0, tl.where(sp == 0, P, 0), BLOCK_N):
            acc, m_i, l_i = _attend_pool_tile(
                acc, m_i, l_i, q, q_hi, freq, j0, pos, row_ok, bh64, P, qk_scale, pool_k, pool_v, pool_pos,
                ROPE, D, D_P, HD, HD_P, BLOCK_N, LOWP, DOT_F32, F32_PRECISION, EMULATE_RTNE,
            )

    if NUM_SPLITS == 1:
        o = tl.math.div_rn(acc, tl.zeros_like(acc) + tl.where(l_i > 0.0, l_i, 1.0)[:, None])
        o = tl.where((l_i > 0.0)[:, None], o, 0.0)
        o_off = (bh64 * M + r[:, None]) * D + d[None, :]
        tl.store(out_ptr + o_off, _cast(o, out_ptr.dtype.element_ty, EMULATE_RTNE),
                 mask=rmask[:, None] & dmask[None, :])
    else:
        w = (bh64 * NUM_SPLITS + sp) * M_PAD + r
        tl.store(ws_m + w, m_i)
        tl.store(ws_l + w, l_i)
        tl.store(ws_acc + w[:, None] * D + d[None, :], acc, mask=dmask[None, :])


@triton.jit
def _decode_softmax_step(s, m_i, l_i, SAFE: tl.constexpr):
    """Online softmax of one query over the scores s [BLOCK_N] (base 2, scale folded into the
    query): (probabilities, rescale of the old accumulator, new max, new sum). SAFE: s may be all
    -inf while the max is still -inf (a tile of pooled tokens or empty pool slots); without a pool
    every tile has a visible token, and the kernel keeps the plain form."""
    m_new = tl.maximum(m_i, tl.max(s, axis=0))
    m_ref = m_new
    if SAFE:
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.math.exp2(s - m_ref)
    alpha = tl.math.exp2(m_i - m_ref)
    l_i = l_i * alpha + tl.sum(p, axis=0)
    return p, alpha, m_new, l_i


@triton.jit
def _decode_scores(q2, q2_rot, freq, positions, k, ROPE: tl.constexpr):
    """Scores [T] of one query q2 [PER, NB] (_decode_tile's layout, scale folded in) against keys k
    [PER, T, NB] (fp32). ROPE: k is pre-RoPE at positions [T]; instead of rotating each key (which
    needs its partner channel, d +- D/2, in another part of the tile) the query is rotated back,
    q . R_t k = (R_t^T q) . k with R_t^T q = q cos - rot(q) sin, from q2_rot = rot(q2) loaded once
    (freq [PER, NB]: inv_freq of each channel)."""
    if ROPE:
        cos, sin = _rope_cos_sin(positions[None, :, None], freq[:, None, :])
        q = q2[:, None, :] * cos - q2_rot[:, None, :] * sin
    else:
        q = q2[:, None, :]
    return tl.sum(tl.sum(q * k, axis=2), axis=0)


@triton.jit
def _decode_tile(
    acc, accz, m_i, l_i, q2, q2_rot, freq, t0, limit, nqk, nqv, pp, bh64, S, NSG,
    k_codes, k_scale, k_zero, k_res, v_codes, v_scale, v_zero, v_res, k_levels, v_levels,
    MIXED: tl.constexpr, HAS_POOL: tl.constexpr, HAS_LEVELS: tl.constexpr, ROPE: tl.constexpr, D: tl.constexpr,
    K_BITS: tl.constexpr, K_PER: tl.constexpr,
    V_BITS: tl.constexpr, V_PER: tl.constexpr, G: tl.constexpr, NGV: tl.constexpr, GV: tl.constexpr,
    R: tl.constexpr, RR: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """One online-softmax step of one query over tokens [t0, t0 + BLOCK_N), all in fp32 registers
    with no tl.dot and no reshapes (see _attend_decode_kernel). BLOCK_N divides G, so the tile lies
    in one key group g = t0 // G. A code tensor is [PER, BLOCK_N, D // PER]: element (i, t, j) is
    channel j * PER + i of token t, the i-th code of byte j. MIXED=False: every token of the tile
    is quantized for keys and values (t0 + BLOCK_N <= min(nqk, nqv)), so nothing is masked and the
    key scale/zero fold into the query: q . (c * s + z) = (q * s) . c + q . z. HAS_POOL: tokens at
    the pooled positions pp are masked (their exact copies come in _decode_pool_tile). HAS_LEVELS:
    codes stand for nuq levels (c above is levels[code]; the folds still hold). ROPE: pre-RoPE keys,
    scored by _decode_scores against the query rotated per token, which is no longer one vector
    for the tile: the keys are dequantized, not folded into the query."""
    t = t0 + tl.arange(0, BLOCK_N)
    row = bh64 * S + t  # int64 token row of codes and value scales
    g = t0 // G

    # ---- keys
    ik = tl.arange(0, K_PER)
    jk = tl.arange(0, D // K_PER)
    ch_k = jk[None, :] * K_PER + ik[:, None]  # [K_PER, NBK] channel of (i, j)
    k_off = (row[:, None] * (D // K_PER) + jk[None, :])[None, :, :]
    ks_off = (bh64 * NSG + g) * D + ch_k
    sh_k = (ik * K_BITS)[:, None, None]
    if MIXED:
        tm = t < limit
        kq = tm & (t < nqk)
        kb = tl.load(k_codes + k_off, mask=kq[None, :, None], other=0)
        gq = g * G < nqk
        ks = tl.load(k_scale + ks_off, mask=gq, other=0.0).to(tl.float32)
        kz = tl.load(k_zero + ks_off, mask=gq, other=0.0).to(tl.float32)
        kc = _code_values((kb.to(tl.int32) >> sh_k) & ((1 << K_BITS) - 1), k_levels, HAS_LEVELS)
        kdq = kc * ks[:, None, :] + kz[:, None, :]
        slot = (bh64 * RR + t % R)[None, :, None] * D + ch_k[:, None, :]
        kres = tl.load(k_res + slot, mask=(tm & (t >= nqk))[None, :, None], other=0.0).to(tl.float32)
        k = tl.where(kq[None, :, None], kdq, kres)
        s = _decode_scores(q2, q2_rot, freq, t, k, ROPE)
        s = tl.where(tm, s, float("-inf"))
    else:
        kb = tl.load(k_codes + k_off)
        ks = tl.load(k_scale + ks_off).to(tl.float32)
        kz = tl.load(k_zero + ks_off).to(tl.float32)
        kc = _code_values((kb.to(tl.int32) >> sh_k) & ((1 << K_BITS) - 1), k_levels, HAS_LEVELS)
        if ROPE:
            s = _decode_scores(q2, q2_rot, freq, t, kc * ks[:, None, :] + kz[:, None, :], ROPE)
        else:
            s = (tl.sum(tl.sum((q2 * ks)[:, None, :] * kc, axis=2), axis=0)
                 + tl.sum(tl.sum(q2 * kz, axis=1), axis=0))
    if HAS_POOL:
        s = tl.where(_in_pool(t, pp), float("-inf"), s)
    p, alpha, m_new, l_i = _decode_softmax_step(s, m_i, l_i, HAS_POOL)

    # ---- values: per-token scale/zero of the GV-channel group of byte j (GV is a multiple of V_PER)
    iv = tl.arange(0, V_PER)
    jv = tl.arange(0, D // V_PER)
    v_off = (row[:, None] * (D // V_PER) + jv[None, :])[None, :, :]
    vs_off = row[:, None] * NGV + (jv * V_PER // GV)[None, :]  # [BLOCK_N, NBV]
    sh_v = (iv * V_BITS)[:, None, None]
    if MIXED:
        vq = tm & (t < nqv)
        vb = tl.load(v_codes + v_off, mask=vq[None, :, None], other=0)
        vs = tl.load(v_scale + vs_off, mask=vq[:, None], other=0.0).to(tl.float32)
        vz = tl.load(v_zero + vs_off, mask=vq[:, None], other=0.0).to(tl.float32)
        vc = _code_values((vb.to(tl.int32) >> sh_v) & ((1 << V_BITS) - 1), v_levels, HAS_LEVELS)
        vdq = vc * vs[None, :, :] + vz[None, :, :]
        ch_v = jv[None, :] * V_PER + iv[:, None]
        slot = (bh64 * RR + t % R)[None, :, None] * D + ch_v[:, None, :]
        vres = tl.load(v_res + slot, mask=(tm & (t >= nqv))[None, :, None], other=0.0).to(tl.float32)
        v = tl.where(vq[None, :, None], vdq, vres)
        acc = acc * alpha + p[None, :, None] * v
        accz = accz * alpha  # [NBV]: the zero-point term sum_t p_t z_t of the fast tiles
    else:
        vb = tl.load(v_codes + v_off)
        vs = tl.load(v_scale + vs_off).to(tl.float32)
        vz = tl.load(v_zero + vs_off).to(tl.float32)
        vc = _code_values((vb.to(tl.int32) >> sh_v) & ((1 << V_BITS) - 1), v_levels, HAS_LEVELS)
        # sum_t p_t (c s + z) = sum_t (p_t s) c + sum_t p_t z: the zero term has no code axis
        acc = acc * alpha + (p[:, None] * vs)[None, :, :] * vc
        accz = accz * alpha + tl.sum(p[:, None] * vz, axis=0)
    return acc, accz, m_new, l_i


@triton.jit
def _decode_pool_tile(
    acc, accz, m_i, l_i, q2, q2_rot, freq, j0, bh64, P, pool_k, pool_v, pool_pos,
    ROPE: tl.constexpr, D: tl.constexpr, K_PER: tl.constexpr, V_PER: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """One online-softmax step of one query over pool slots [j0, j0 + BLOCK_N): exact keys/values,
    in the [PER, BLOCK_N, D // PER] layout of _decode_tile. Every filled slot is visible: pooled
    tokens are stored tokens, all at or before the decode query (position L - 1). ROPE: pre-RoPE
    pool keys at their pool_pos (_decode_scores)."""
    j = j0 + tl.arange(0, BLOCK_N)
    jm = j < P
    ppos = tl.load(pool_pos + bh64 * P + j, mask=jm, other=-1)
    filled = ppos >= 0
    row = bh64 * P + j
    ik = tl.arange(0, K_PER)
    jk = tl.arange(0, D // K_PER)
    ch_k = jk[None, :] * K_PER + ik[:, None]
    k = tl.load(pool_k + row[None, :, None] * D + ch_k[:, None, :], mask=jm[None, :, None], other=0.0)
    s = _decode_scores(q2, q2_rot, freq, ppos, k.to(tl.float32), ROPE)
    s = tl.where(filled, s, float("-inf"))
    p, alpha, m_new, l_i = _decode_softmax_step(s, m_i, l_i, True)
    iv = tl.arange(0, V_PER)
    jv = tl.arange(0, D // V_PER)
    ch_v = jv[None, :] * V_PER + iv[:, None]
    v = tl.load(pool_v + row[None, :, None] * D + ch_v[:, None, :], mask=jm[None, :, None], other=0.0)
    acc = acc * alpha + p[None, :, None] * v.to(tl.float32)
    accz = accz * alpha
    return acc, accz, m_new, l_i


@triton.jit
def _attend_decode_kernel(
    q_ptr, s_qb, s_qh, s_qd,
    k_codes, k_scale, k_zero, k_res, v_codes, v_scale, v_zero, v_res, lengths_ptr, counts_ptr,
    pool_k, pool_v, pool_pos, k_levels, v_levels, rope_inv_freq, ws_m, ws_l, ws_acc, out_ptr,
    H, HQ, S, NSG, P, qk_scale,
    HAS_COUNTS: tl.constexpr, HAS_POOL: tl.constexpr, P_P: tl.constexpr, HAS_LEVELS: tl.constexpr,
    ROPE: tl.constexpr, QG: tl.constexpr, D: tl.constexpr,
    K_BITS: tl.constexpr, K_PER: tl.constexpr, V_BITS: tl.constexpr, V_PER: tl.constexpr,
    G: tl.constexpr, NGV: tl.constexpr, GV: tl.constexpr, R: tl.constexpr, RR: tl.constexpr,
    BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr, EMULATE_RTNE: tl.constexpr,
):
    """Decode (q_len == 1): one program per (batch row, query head, split). GQA heads of one kv
    head read the same codes (L2 hits). Work items are per element, no tl.dot: a decode query is
    one row, and padding it to a 16-row tensor-core tile cost more in layout shuffles through
    shared memory than the products themselves (measured on H100, see benchmarks/results)."""
    pid = tl.program_id(0)
    sp = tl.program_id(1)
    b = pid // HQ
    hq = pid % HQ
    bh64 = (b * H + hq // QG).to(tl.int64)
    L = tl.load(lengths_ptr + b).to(tl.int32)
    nqk = (L // R) * R
    nqv = tl.maximum(L - R, 0)

    ik = tl.arange(0, K_PER)
    jk = tl.arange(0, D // K_PER)
    ch_k = jk[None, :] * K_PER + ik[:, None]
    q_row = q_ptr + b.to(tl.int64) * s_qb + hq.to(tl.int64) * s_qh
    q2 = tl.load(q_row + ch_k.to(tl.int64) * s_qd).to(tl.float32)
    q2 = q2 * qk_scale
    if ROPE:
        # rot(q) = cat(-q[D/2:], q[:D/2]) (rope._rotate_half), read from the partner channels
        partner = (ch_k + D // 2) % D
        q2_rot = tl.load(q_row + partner.to(tl.int64) * s_qd).to(tl.float32) * qk_scale
        q2_rot = tl.where(ch_k < D // 2, -q2_rot, q2_rot)
        freq = tl.load(rope_inv_freq + ch_k % (D // 2))
    else:
        q2_rot = q2  # unused
        freq = q2  # unused

    split_len = tl.cdiv(tl.cdiv(L, NUM_SPLITS), BLOCK_N) * BLOCK_N
    lo = sp * split_len
    hi = tl.minimum(lo + split_len, L)
    # Split 0 also takes the pool's exact tokens; the reduce kernel merges them like any split.
    pool_end = tl.where(sp == 0, P, 0)
    if HAS_COUNTS:
        real = tl.load(counts_ptr + b) > 0
        hi = tl.where(real, hi, lo)  # a padded row (counts 0) attends to nothing: 0
        pool_end = tl.where(real, pool_end, 0)
    mid = tl.maximum(tl.minimum((tl.minimum(nqk, nqv) // BLOCK_N) * BLOCK_N, hi), lo)

    pp = _load_pool_positions(pool_pos, bh64, P, P_P, HAS_POOL)
    m_i = tl.full([], float("-inf"), tl.float32)
    l_i = tl.zeros([], tl.float32)
    acc = tl.zeros([V_PER, BLOCK_N, D // V_PER], tl.float32)
    accz = tl.zeros([D // V_PER], tl.float32)
    for t0 in range(lo, mid, BLOCK_N):
        acc, accz, m_i, l_i = _decode_tile(
            acc, accz, m_i, l_i, q2, q2_rot, freq, t0, mid, nqk, nqv, pp, bh64, S, NSG,
            k_codes, k_scale, k_zero, k_res, v_codes, v_scale, v_zero, v_res, k_levels, v_levels,
            False, HAS_POOL, HAS_LEVELS, ROPE, D, K_BITS, K_PER, V_BITS, V_PER, G, NGV, GV, R, RR, BLOCK_N,
        )
    for t0 in range(mid, hi, BLOCK_N):
        acc, accz, m_i, l_i = _decode_tile(
            acc, accz, m_i, l_i, q2, q2_rot, freq, t0, hi, nqk, nqv, pp, bh64, S, NSG,
            k_codes, k_scale, k_zero, k_res, v_codes, v_scale, v_zero, v_res, k_levels, v_levels,
            True, HAS_POOL, HAS_LEVELS, ROPE, D, K_BITS, K_PER, V_BITS, V_PER, G, NGV, GV, R, RR, BLOCK_N,
        )
    if HAS_POOL:
        for j0 in range(0, pool_end, BLOCK_N):
            acc, accz, m_i, l_i = _decode_pool_tile(
                acc, accz, m_i, l_i, q2, q2_rot, freq, j0, bh64, P, pool_k, pool_v, pool_pos,
                ROPE, D, K_PER, V_PER, BLOCK_N,
            )

    iv = tl.arange(0, V_PER)
    jv = tl.arange(0, D // V_PER)
    ch_v = jv[None, :] * V_PER + iv[:, None]  # [V_PER, NBV]
    o = tl.sum(acc, axis=1) + accz[None, :]
    if NUM_SPLITS == 1:
        o = tl.math.div_rn(o, tl.zeros_like(o) + tl.where(l_i > 0.0, l_i, 1.0))
        o = tl.where(l_i > 0.0, o, 0.0)
        tl.store(out_ptr + pid.to(tl.int64) * D + ch_v, _cast(o, out_ptr.dtype.element_ty, EMULATE_RTNE))
    else:
        w = (bh64 * NUM_SPLITS + sp) * QG + hq % QG
        tl.store(ws_m + w, m_i)
        tl.store(ws_l + w, l_i)
        tl.store(ws_acc + w * D + ch_v, o)


@triton.jit
def _attend_reduce_kernel(
    ws_m, ws_l, ws_acc, out_ptr, M, M_PAD,
    D: tl.constexpr, D_P: tl.constexpr, NUM_SPLITS: tl.constexpr, SPLITS_P: tl.constexpr,
    EMULATE_RTNE: tl.constexpr,
):
    rid = tl.program_id(0).to(tl.int64)
    bh = rid // M
    r = rid % M
    sidx = tl.arange(0, SPLITS_P)
    smask = sidx < NUM_SPLITS
    w = (bh * NUM_SPLITS + sidx) * M_PAD + r
    m = tl.load(ws_m + w, mask=smask, other=float("-inf"))
    l = tl.load(ws_l + w, mask=smask, other=0.0)
    gmax = tl.max(m, axis=0)
    gmax = tl.where(gmax == float("-inf"), 0.0, gmax)
    wt = tl.math.exp2(m - gmax)  # empty splits (m = -inf) weigh 0
    l_tot = tl.sum(wt * l, axis=0)
    d = tl.arange(0, D_P)
    dmask = d < D
    acc = tl.load(ws_acc + w[:, None] * D + d[None, :], mask=smask[:, None] & dmask[None, :], other=0.0)
    o = tl.sum(wt[:, None] * acc, axis=0)
    o = tl.math.div_rn(o, tl.zeros_like(o) + tl.where(l_tot > 0.0, l_tot, 1.0))
    o = tl.where(l_tot > 0.0, o, 0.0)
    tl.store(out_ptr + (bh * M + r) * D + d, _cast(o, out_ptr.dtype.element_ty, EMULATE_RTNE), mask=dmask)


_SM_COUNT: dict = {}


def _num_programs_target(device: torch.device) -> int:
    """Programs that fill the device (static per device, so fine under CUDA graphs)."""
    if device.type != "cuda":
        return 8  # interpreter: a few splits, to exercise the merge
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return 2 * _SM_COUNT[idx]


def attend_num_splits(batch_heads: int, m_blocks: int, max_seq_len: int, block_n: int, device) -> int:
    """Splits of the token axis from static shapes only: enough programs to fill the GPU, never
    more than the token blocks of a full cache nor MAX_SPLITS."""
    programs = max(1, batch_heads * m_blocks)
    want = triton.cdiv(_num_programs_target(torch.device(device)), programs)
    return max(1, min(want, triton.cdiv(max(max_seq_len, 1), block_n), MAX_SPLITS))


def attend_launch_config(head_dim: int, lowp: bool, rows: int) -> tuple[int, int, int]:
    """(BLOCK_M query rows, BLOCK_N tokens per tile, num_warps) for M = rows query rows per kv head.

    Chosen from sm_90 compiles (ptxas; no GPU was at hand, so not tuned on hardware): no register
    spills and <= ~110 KB shared memory at num_stages=2 (fp32 D=128 with 32 rows spills 8 bytes).
    Decode (rows <= 16): fp16/bf16 (64, 4) ~160 registers; fp32 D<=64 (32, 4) ~157, D=128 (32, 8)
    ~201. Prefill chunks take 32/64-row tiles with 8 warps; fp32 tiles stop at 32 rows."""
    block_m = min(64 if lowp else 32, max(16, next_pow2(rows)))
    if block_m == 16:
        if lowp:
            return block_m, 64, 4
        return (block_m, 32, 4) if head_dim <= 64 else (block_m, 32, 8)
    if lowp:
        return (block_m, 64, 8) if head_dim <= 64 else (block_m, 32, 8)
    return (block_m, 32, 8) if head_dim <= 64 else (block_m, 16, 8)


def _split_workspace(rows: int, num_splits: int, m: int, D: int, out: torch.Tensor):
    """fp32 (max, sum, partial output) per split for the reduction kernel; none for one split
    (the kernel then writes `out` directly and never touches the workspace arguments)."""
    if num_splits == 1:
        return out, out, out
    ws_m = torch.empty((rows, num_splits, m), dtype=torch.float32, device=out.device)
    return ws_m, torch.empty_like(ws_m), torch.empty((rows, num_splits, m, D), dtype=torch.float32, device=out.device)


def _pool_launch_args(pool, k_res, lengths) -> tuple:
    """(pool_k, pool_v, pool_pos, P, HAS_POOL, P_P) for the attention kernels. Without a pool (or
    with zero slots) the pointers are dummies the kernels never read and HAS_POOL is False, so
    they compile exactly as without the pool feature."""
    if pool is None or pool[2].shape[-1] == 0:
        return k_res, k_res, lengths, 0, False, 1
    pool_k, pool_v, pool_pos = pool
    B, H, _, D = k_res.shape
    P = pool_pos.shape[-1]
    if (tuple(pool_k.shape) != (B, H, P, D) or tuple(pool_v.shape) != (B, H, P, D)
            or tuple(pool_pos.shape) != (B, H, P) or pool_pos.dtype != torch.int64):
        raise ValueError(f"pool_k/pool_v must be {(B, H, P, D)} and pool_pos int64 {(B, H, P)}")
    if pool_k.dtype != k_res.dtype or pool_v.dtype != k_res.dtype:
        raise ValueError(f"pool_k/pool_v must have the cache dtype {k_res.dtype}")
    if not (pool_k.is_contiguous() and pool_v.is_contiguous() and pool_pos.is_contiguous()):
        raise ValueError("pool buffers must be contiguous (whole registered buffers)")
    return pool_k, pool_v, pool_pos, P, True, next_pow2(P)


def _extras_launch_args(extras: Extras, k_codes, k_scale, k_res, k_bits, v_bits, residual_length) -> tuple:
    """(k_levels, v_levels, rope_inv_freq, HAS_LEVELS, ROPE) for the attention kernels; absent ones
    are dummy pointers the kernels never read (the flags off compile the plain kernels)."""
    extras = _check_kernel_extras(extras, k_codes, k_res, k_bits, v_bits, residual_length)
    has_levels, rope = extras.k_levels is not None, extras.rope_inv_freq is not None
    D = k_res.shape[-1]
    # Pre-RoPE keys are dequantized in halves of D/2 channels: each half whole bytes of codes.
    if rope and (D % 2 or (D // 2) % codes_per_byte(k_bits)):
        raise ValueError(f"pre-RoPE keys need head_dim / 2 = {D / 2} to be a multiple of "
                         f"{codes_per_byte(k_bits)} ({k_bits}-bit codes per byte)")
    return (extras.k_levels if has_levels else k_scale, extras.v_levels if has_levels else k_scale,
            extras.rope_inv_freq if rope else k_scale, has_levels, rope)


def cache_attend_triton(
    query, k_codes, k_scale, k_zero, k_res, v_codes, v_scale, v_zero, v_res, lengths,
    counts, k_bits, v_bits, group_size, residual_length, scale,
    num_splits: Optional[int] = None, block_n: Optional[int] = None,
    num_warps: Optional[int] = None, num_stages: int = 2, pool=None, extras: Extras = NO_EXTRAS,
) -> torch.Tensor:
    """Attention of query [B, Hq, q, D] over the cache, like cache_attend_reference (module doc).
    pool: None or (pool_k, pool_v, pool_pos), the full-precision token pool (pool.py): pooled
    tokens are masked out of the cache tiles and split 0 adds their exact keys/values to its
    online softmax. extras: nuq levels and/or rope_inv_freq (pre-RoPE keys); not the sparse
    outlier store. num_splits / block_n / num_warps / num_stages override the static choices
    (tests, tuning)."""
    B, H, S, D, R, RR, G, gv = _check_cache(k_codes, k_scale, k_zero, k_res, v_codes, v_scale, v_zero, v_res,
                                        lengths, k_bits, v_bits, group_size, residual_length)
    pool_args = _pool_launch_args(pool, k_res, lengths)
    extras_args = _extras_launch_args(extras, k_codes, k_scale, k_res, k_bits, v_bits, residual_length)
    Bq, Hq, q_len, Dq = query.shape
    if Bq != B or Dq != D or Hq % H:
        raise ValueError(f"query {tuple(query.shape)} does not match the cache (B={B}, H={H}, D={D})")
    out = torch.empty((B, Hq, q_len, D), dtype=query.dtype, device=query.device)
    if out.numel() == 0:
        return out
    QG = Hq // H
    M = QG * q_len
    if q_len == 1 and D == next_pow2(D):
        return _attend_decode(query, k_codes, k_scale, k_zero, k_res, v_codes, v_scale, v_zero, v_res, lengths,
                              counts, k_bits, v_bits, G, R, RR, gv, scale, out, num_splits, block_n, num_warps,
                              num_stages, pool_args, extras_args)
    k_levels, v_levels, rope_inv_freq, has_levels, rope = extras_args
    if D < 16:
        raise ValueError(f"cache_attend_triton needs head_dim >= 16 (tl.dot), got {D}")
    lowp = k_res.dtype != torch.float32
    block_m, default_block_n, default_warps = attend_launch_config(D, lowp, M)
    num_warps = num_warps or default_warps
    m_blocks = triton.cdiv(M, block_m)
    m_pad = m_blocks * block_m
    d_p = next_pow2(D)
    if block_n is None:
        block_n = default_block_n
    if block_n < 16 or block_n & (block_n - 1):
        raise ValueError(f"block_n must be a power of two >= 16, got {block_n}")
    ngv, ngv_p, gv_p = D // gv, next_pow2(D // gv), next_pow2(gv)
    assert ngv_p * gv_p == d_p, (D, gv)
    if num_splits is None:
        num_splits = attend_num_splits(B * H, m_blocks, S, block_n, query.device)
    num_splits = max(1, min(int(num_splits), MAX_SPLITS))
    dtype = k_res.dtype
    interp = interpreting()
    # The interpreter's tl.dot cannot take bf16 operands (numpy has no bf16): there the rounded
    # fp16/bf16 operands are upcast to fp32 (exact), which equals the tensor-core products.
    dot_f32 = (not lowp) or interp
    if not lowp and query.dtype != torch.float32:
        query = query.float()
    if lowp and query.dtype != dtype:
        query = query.to(dtype)
    has_counts = counts is not None
    cnt = counts if has_counts else lengths
    ws_m, ws_l, ws_acc = _split_workspace(B * H, num_splits, m_pad, D, out)
    kper, vper = codes_per_byte(k_bits), codes_per_byte(v_bits)
    pool_k, pool_v, pool_pos, P, has_pool, p_p = pool_args
    wrap = torch.library.wrap_triton
    with device_ctx(query):
        wrap(_attend_split_kernel)[(B * H, m_blocks, num_splits)](
            query, query.stride(0), query.stride(1), query.stride(2), query.stride(3),
            k_codes, k_scale, k_zero, k_res, v_codes, v_scale, v_zero, v_res, lengths, cnt,
            pool_k, pool_v, pool_pos, k_levels, v_levels, rope_inv_freq, ws_m, ws_l, ws_acc, out,
            H, S, k_scale.shape[2], q_len, M, m_pad, P, float(scale) * LOG2E,
            HAS_COUNTS=has_counts, HAS_POOL=has_pool, P_P=p_p, HAS_LEVELS=has_levels, ROPE=rope,
            # pre-RoPE halves padded to tl.dot's K >= 16 (zero channels add nothing)
            QG=QG, D=D, D_P=d_p, HD=D // 2, HD_P=max(16, next_pow2(D // 2)),
            K_BITS=k_bits, K_PER=kper, V_BITS=v_bits, V_PER=vper,
            G=G, NGB=max(block_n // G, 1), NGV=ngv, NGV_P=ngv_p, GV_P=gv_p,
            R=R, RR=RR, BLOCK_M=block_m, BLOCK_N=block_n, NUM_SPLITS=num_splits,
            LOWP=lowp, DOT_F32=dot_f32, F32_PRECISION=F32_DOT_PRECISION, EMULATE_RTNE=interp,
            num_warps=num_warps, num_stages=num_stages,
        )
        if num_splits > 1:
            wrap(_attend_reduce_kernel)[(B * H * M,)](
                ws_m, ws_l, ws_acc, out, M, m_pad,
                D=D, D_P=d_p, NUM_SPLITS=num_splits, SPLITS_P=next_pow2(num_splits),
                EMULATE_RTNE=interp, num_warps=4,
            )
    return out


DECODE_BLOCK_N = 32
DECODE_PROGRAMS_PER_SM = 16
DECODE_NUM_WARPS = 1


def _attend_decode(query, k_codes, k_scale, k_zero, k_res, v_codes, v_scale, v_zero, v_res, lengths, counts,
                   k_bits, v_bits, G, R, RR, gv, scale, out, num_splits, block_n, num_warps, num_stages, pool_args,
                   extras_args):
    """Launch _attend_decode_kernel (q_len == 1, power-of-two head_dim) and the split merge."""
    B, Hq, _, D = query.shape
    H, S = k_codes.shape[1], k_codes.shape[2]
    QG = Hq // H
    block_n = min(block_n or DECODE_BLOCK_N, G)  # a tile never straddles a key group
    if num_splits is None:
        target = _num_programs_target(query.device) // 2 * DECODE_PROGRAMS_PER_SM
        num_splits = max(1, min(triton.cdiv(target, B * Hq), triton.cdiv(max(S, 1), block_n), MAX_SPLITS))
    num_splits = max(1, min(int(num_splits), MAX_SPLITS))
    if query.dtype != k_res.dtype:
        query = query.to(k_res.dtype)
    has_counts = counts is not None
    ws_m, ws_l, ws_acc = _split_workspace(B * H, num_splits, QG, D, out)
    interp = interpreting()
    pool_k, pool_v, pool_pos, P, has_pool, p_p = pool_args
    k_levels, v_levels, rope_inv_freq, has_levels, rope = extras_args
    wrap = torch.library.wrap_triton
    with device_ctx(query):
        wrap(_attend_decode_kernel)[(B * Hq, num_splits)](
            query, query.stride(0), query.stride(1), query.stride(3),
            k_codes, k_scale, k_zero, k_res, v_codes, v_scale, v_zero, v_res, lengths,
            counts if has_counts else lengths, pool_k, pool_v, pool_pos, k_levels, v_levels, rope_inv_freq,
            ws_m, ws_l, ws_acc, out,
            H, Hq, S, k_scale.shape[2], P, float(scale) * LOG2E,
            HAS_COUNTS=has_counts, HAS_POOL=has_pool, P_P=p_p, HAS_LEVELS=has_levels, ROPE=rope,
            QG=QG, D=D, K_BITS=k_bits, K_PER=codes_per_byte(k_bits),
            V_BITS=v_bits, V_PER=codes_per_byte(v_bits), G=G, NGV=D // gv, GV=gv, R=R, RR=RR,
            BLOCK_N=block_n, NUM_SPLITS=num_splits, EMULATE_RTNE=interp,
            num_warps=num_warps or DECODE_NUM_WARPS, num_stages=num_stages,
        )
        if num_splits > 1:
            wrap(_attend_reduce_kernel)[(B * Hq,)](
                ws_m, ws_l, ws_acc, out, QG, QG,
                D=D, D_P=D, NUM_SPLITS=num_splits, SPLITS_P=next_pow2(num_splits),
                EMULATE_RTNE=interp, num_warps=4,
            )
    return out
