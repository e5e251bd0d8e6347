"""Triton split-K attention over the KIVI cache, any q_len: attend_split.

Layout and streaming policy: kivi_ops/layout.py; kernels/reference.py (attend_reference) is the
specification the kernels are tested against. What both attention kernels share (the split merge,
the pool and KVQuant options, CUDA-graph safety): triton_attend.py. The dispatcher (dispatch.py)
sends decode steps (q_len == 1) with a power-of-two head_dim to triton_decode.py; this kernel
takes every other call, q_len == 1 included (needs head_dim >= 16, for tl.dot).

attend_split:
  1. _attend_split_kernel grid (B*H, cdiv(M, BLOCK_M), num_splits), M = (Hq/H) * q_len: one
     program owns every query row of one kv head (GQA without repeat_kv; row r = g*q_len + i is
     query i of head h*Hq/H + g; rows padded to BLOCK_M >= 16 for tl.dot) and one contiguous token
     range of its sequence, cut at run time from the sequence's own length (triton_attend.py);
     num_splits comes from static shapes only (attend_num_splits, triton_attend.py).
     Per BLOCK_N-token tile (_attend_tile) it unpacks the 2/4/8-bit codes in registers,
     dequantizes (keys: per channel, one scale row per G tokens; values: per token, scale column
     c // Gv), selects quantized vs residual per token (key quantized iff t < (L // R) * R, value
     iff t < L - R; residual slot t % R) and runs an online softmax (base 2, scale * log2(e)
     folded in). Tiles below min(nqk, nqv) take a path with no residual loads or selects; only
     the last <= R + BLOCK_N tokens take the mixed path.
  2. _attend_reduce_kernel (triton_attend.py) grid (B*H*M,) when num_splits > 1.
  With the pool, split 0 runs the P pool keys/values in BLOCK_N-slot tiles (_attend_pool_tile;
  visible: filled slots at or before the query, real rows).
  Pre-RoPE keys (ROPE): keys are dequantized as two D/2-channel halves, rotated in fp32
  (rotate-half is a mix of the two halves) and scored with two tl.dot of D/2 (_rope_qk).
  Products use tl.dot: fp16/bf16 caches on tensor cores with the dequantized keys/values and the
  probabilities rounded to the cache dtype and fp32 accumulation (like fp16 flash attention);
  fp32 caches with F32_DOT_PRECISION ("tf32x3" by default, see there). The rounded keys/values
  and the output are saturated to the dtype's finite range first (_cast_sat, packing.py's rule:
  fp16 q * s + z can reach 65536); q . k and p . v accumulate in fp32 and stay finite for fp16.
  The query is used in the cache dtype (cast if it differs); the output has the query's dtype.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ..layout import LayerTensors, QuantParams
from ..packing import codes_per_byte
from .triton_attend import (
    LOG2E, _cast, _cast_sat, _code_values, _in_pool, _load_pool_positions, _rope_cos_sin, attend_setup,
    attend_num_splits, launch_reduce, split_workspace,
)
from .triton_quant import device_ctx, interpreting, next_pow2, unpack_codes

# fp32 caches: tl.dot precision of the attention products. "tf32x3" (three TF32 tensor-core
# products, error ~2^-22 relative per product, i.e. fp32-accumulation class) instead of "ieee"
# (FMA loop: ~5x the FMAs for 3 real query rows padded to 16, and register spills at D=128).
# The interpreter ignores it (numpy fp32). Set to "ieee" for exact-fp32 products.
F32_DOT_PRECISION = "tf32x3"


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
        lo = _cast_sat(lo, DT, EMULATE_RTNE)
        hi = _cast_sat(hi, DT, EMULATE_RTNE)
    return _qk_dot(q_lo, lo, DOT_F32, F32_PRECISION) + _qk_dot(q_hi, hi, DOT_F32, F32_PRECISION)


@triton.jit
def _key_tile(
    t, tm, t0, limit, nqk, row, bh64, NSG, k_codes, k_scale, k_zero, k_res, k_levels, k_sparse, k_sparse_idx, NKR,
    C0: tl.constexpr, W: tl.constexpr, W_P: tl.constexpr, MIXED: tl.constexpr, HAS_LEVELS: tl.constexpr,
    CAST: tl.constexpr, D: tl.constexpr, K_BITS: tl.constexpr, K_PER: tl.constexpr, G: tl.constexpr,
    NGB: tl.constexpr, R: tl.constexpr, RR: tl.constexpr, BLOCK_N: tl.constexpr, EMULATE_RTNE: tl.constexpr,
    SPARSE: tl.constexpr, NK: tl.constexpr,
):
    """Keys [BLOCK_N, W_P] of tokens t, channels [C0, C0 + W) (the whole head, or one RoPE half):
    per-channel groups of G tokens, one scale row per group; fp32, or rounded to the cache dtype
    when CAST. MIXED: per-token choice between the dequantized codes and the residual ring.
    SPARSE: the exact key outliers (per channel, NK per R-window: rows w * NK + j of k_sparse,
    token offsets in k_sparse_idx, -1 none) replace their dequantized entries."""
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
        kdq = _cast_sat(kdq, k_res.dtype.element_ty, EMULATE_RTNE)
    if SPARSE:
        w = t // R  # a tile may span windows (BLOCK_N > R)
        om = kq[:, None] & cmask[None, :]
        for j in range(NK):
            srow = ((bh64 * NKR + w * NK + j)[:, None]) * D + (C0 + c)[None, :]
            exact = tl.load(k_sparse + srow, mask=om, other=0.0)
            off = tl.load(k_sparse_idx + srow, mask=om, other=-1).to(tl.int32)
            hit = (off >= 0) & ((w[:, None] * R + off) == t[:, None]) & om
            kdq = tl.where(hit, exact.to(kdq.dtype), kdq)
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
    k_sparse, k_sparse_idx, v_sparse, v_sparse_idx, NKR,
    MIXED: tl.constexpr, HAS_POOL: tl.constexpr, HAS_LEVELS: tl.constexpr, ROPE: tl.constexpr,
    D: tl.constexpr, D_P: tl.constexpr, HD: tl.constexpr, HD_P: tl.constexpr,
    K_BITS: tl.constexpr, K_PER: tl.constexpr, V_BITS: tl.constexpr, V_PER: tl.constexpr,
    G: tl.constexpr, NGB: tl.constexpr, NGV: tl.constexpr, NGV_P: tl.constexpr, GV_P: tl.constexpr,
    R: tl.constexpr, RR: tl.constexpr, BLOCK_N: tl.constexpr,
    LOWP: tl.constexpr, DOT_F32: tl.constexpr, F32_PRECISION: tl.constexpr, EMULATE_RTNE: tl.constexpr,
    SPARSE: tl.constexpr, NK: tl.constexpr, NV: tl.constexpr,
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
                         k_sparse, k_sparse_idx, NKR, 0, HD, HD_P, MIXED, HAS_LEVELS, False, D, K_BITS, K_PER, G, NGB,
                         R, RR, BLOCK_N, EMULATE_RTNE, SPARSE, NK)
        k_hi = _key_tile(t, tm, t0, limit, nqk, row, bh64, NSG, k_codes, k_scale, k_zero, k_res, k_levels,
                         k_sparse, k_sparse_idx, NKR, HD, HD, HD_P, MIXED, HAS_LEVELS, False, D, K_BITS, K_PER, G,
                         NGB, R, RR, BLOCK_N, EMULATE_RTNE, SPARSE, NK)
        s = _rope_qk(q, q_hi, k_lo, k_hi, t, freq, DT, LOWP, DOT_F32, F32_PRECISION, EMULATE_RTNE)
    else:
        k = _key_tile(t, tm, t0, limit, nqk, row, bh64, NSG, k_codes, k_scale, k_zero, k_res, k_levels,
                      k_sparse, k_sparse_idx, NKR, 0, D, D_P, MIXED, HAS_LEVELS, LOWP, D, K_BITS, K_PER, G, NGB,
                      R, RR, BLOCK_N, EMULATE_RTNE, SPARSE, NK)
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
        vdq = _cast_sat(vdq, DT, EMULATE_RTNE)
    if SPARSE:  # per token, the NV exact value outliers (channels in v_sparse_idx, -1 none)
        for j in range(NV):
            exact = tl.load(v_sparse + row * NV + j, mask=vq, other=0.0)
            vch = tl.load(v_sparse_idx + row * NV + j, mask=vq, other=-1).to(tl.int32)
            vdq = tl.where(d[None, :] == vch[:, None], exact.to(vdq.dtype)[:, None], vdq)
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
    k_sparse, k_sparse_idx, v_sparse, v_sparse_idx,
    H, S, NSG, Q_LEN, M, M_PAD, P, NKR, qk_scale,
    HAS_COUNTS: tl.constexpr, HAS_POOL: tl.constexpr, P_P: tl.constexpr, HAS_LEVELS: tl.constexpr,
    ROPE: tl.constexpr, QG: tl.constexpr, D: tl.constexpr, D_P: tl.constexpr, HD: tl.constexpr, HD_P: tl.constexpr,
    K_BITS: tl.constexpr, K_PER: tl.constexpr, V_BITS: tl.constexpr, V_PER: tl.constexpr,
    G: tl.constexpr, NGB: tl.constexpr, NGV: tl.constexpr, NGV_P: tl.constexpr, GV_P: tl.constexpr,
    R: tl.constexpr, RR: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
    LOWP: tl.constexpr, DOT_F32: tl.constexpr, F32_PRECISION: tl.constexpr, EMULATE_RTNE: tl.constexpr,
    SPARSE: tl.constexpr, NK: tl.constexpr, NV: tl.constexpr,
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
            k_sparse, k_sparse_idx, v_sparse, v_sparse_idx, NKR,
            False, HAS_POOL, HAS_LEVELS, ROPE, D, D_P, HD, HD_P, K_BITS, K_PER, V_BITS, V_PER,
            G, NGB, NGV, NGV_P, GV_P, R, RR, BLOCK_N, LOWP, DOT_F32, F32_PRECISION, EMULATE_RTNE, SPARSE, NK, NV,
        )
    for t0 in range(mid, hi, BLOCK_N):
        acc, m_i, l_i = _attend_tile(
            acc, m_i, l_i, q, q_hi, freq, t0, hi, nqk, nqv, pos, row_ok, pp, bh64, S, NSG, qk_scale,
            k_codes, k_scale, k_zero, k_res, v_codes, v_scale, v_zero, v_res, k_levels, v_levels,
            k_sparse, k_sparse_idx, v_sparse, v_sparse_idx, NKR,
            True, HAS_POOL, HAS_LEVELS, ROPE, D, D_P, HD, HD_P, K_BITS, K_PER, V_BITS, V_PER,
            G, NGB, NGV, NGV_P, GV_P, R, RR, BLOCK_N, LOWP, DOT_F32, F32_PRECISION, EMULATE_RTNE, SPARSE, NK, NV,
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
        tl.store(out_ptr + o_off, _cast_sat(o, out_ptr.dtype.element_ty, EMULATE_RTNE),
                 mask=rmask[:, None] & dmask[None, :])
    else:
        w = (bh64 * NUM_SPLITS + sp) * M_PAD + r
        tl.store(ws_m + w, m_i)
        tl.store(ws_l + w, l_i)
        tl.store(ws_acc + w[:, None] * D + d[None, :], acc, mask=dmask[None, :])


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


def attend_split(
    query: torch.Tensor, t: LayerTensors, counts: Optional[torch.Tensor], p: QuantParams, scale: float, *,
    num_splits: Optional[int] = None, block_n: Optional[int] = None, num_warps: Optional[int] = None,
    num_stages: int = 2,
) -> torch.Tensor:
    """Attention of query [B, Hq, q, D] over the cache, like attend_reference (module doc); any
    q_len, head_dim >= 16. The pool (t.pool) and KVQuant's nuq levels, pre-RoPE keys and sparse
    outlier store (t.extras) are read by the kernel.
    num_splits / block_n / num_warps / num_stages override the static choices (tests, tuning)."""
    (B, H, S, D, R, RR, G, gv), pool_args, extras_args, sparse_args, out = attend_setup(query, t, p)
    k_sparse, k_sparse_idx, v_sparse, v_sparse_idx, nkr, nk, nv, sparse = sparse_args
    if out.numel() == 0:
        return out
    k_codes, k_scale, k_zero, k_res, v_codes, v_scale, v_zero, v_res, lengths = t.kivi
    k_bits, v_bits = p.k_bits, p.v_bits
    Hq, q_len = query.shape[1], query.shape[2]
    QG = Hq // H
    M = QG * q_len
    k_levels, v_levels, rope_inv_freq, has_levels, rope = extras_args
    if D < 16:
        raise ValueError(f"attend_split needs head_dim >= 16 (tl.dot), got {D}")
    lowp = k_res.dtype != torch.float32
    block_m, default_block_n, default_warps = attend_launch_config(D, lowp, M)
    num_warps = num_warps or default_warps
    m_blocks = triton.cdiv(M, block_m)
    m_pad = m_blocks * block_m
    d_p = next_pow2(D)
    if block_n is None:
        # The outliers' [BLOCK_N, D] rows cost registers: half-size tiles keep the sm_90 compile
        # free of spills (ptxas_sm90.json).
        block_n = max(16, default_block_n // 2) if sparse else default_block_n
    if block_n < 16 or block_n & (block_n - 1):
        raise ValueError(f"block_n must be a power of two >= 16, got {block_n}")
    ngv, ngv_p, gv_p = D // gv, next_pow2(D // gv), next_pow2(gv)
    assert ngv_p * gv_p == d_p, (D, gv)
    num_splits = attend_num_splits(B * H * m_blocks, S, block_n, query.device, requested=num_splits)
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
    ws_m, ws_l, ws_acc = split_workspace(B * H, num_splits, m_pad, D, out)
    kper, vper = codes_per_byte(k_bits), codes_per_byte(v_bits)
    pool_k, pool_v, pool_pos, P, has_pool, p_p = pool_args
    wrap = torch.library.wrap_triton
    with device_ctx(query):
        wrap(_attend_split_kernel)[(B * H, m_blocks, num_splits)](
            query, query.stride(0), query.stride(1), query.stride(2), query.stride(3),
            k_codes, k_scale, k_zero, k_res, v_codes, v_scale, v_zero, v_res, lengths, cnt,
            pool_k, pool_v, pool_pos, k_levels, v_levels, rope_inv_freq, ws_m, ws_l, ws_acc, out,
            k_sparse, k_sparse_idx, v_sparse, v_sparse_idx,
            H, S, k_scale.shape[2], q_len, M, m_pad, P, nkr, float(scale) * LOG2E,
            HAS_COUNTS=has_counts, HAS_POOL=has_pool, P_P=p_p, HAS_LEVELS=has_levels, ROPE=rope,
            # pre-RoPE halves padded to tl.dot's K >= 16 (zero channels add nothing)
            QG=QG, D=D, D_P=d_p, HD=D // 2, HD_P=max(16, next_pow2(D // 2)),
            K_BITS=k_bits, K_PER=kper, V_BITS=v_bits, V_PER=vper,
            G=G, NGB=max(block_n // G, 1), NGV=ngv, NGV_P=ngv_p, GV_P=gv_p,
            R=R, RR=RR, BLOCK_M=block_m, BLOCK_N=block_n, NUM_SPLITS=num_splits,
            LOWP=lowp, DOT_F32=dot_f32, F32_PRECISION=F32_DOT_PRECISION, EMULATE_RTNE=interp,
            SPARSE=sparse, NK=nk, NV=nv, num_warps=num_warps, num_stages=num_stages,
        )
        if num_splits > 1:
            launch_reduce(ws_m, ws_l, ws_acc, out, B * H, M, m_pad, num_splits)
    return out
