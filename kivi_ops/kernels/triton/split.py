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
     Per BLOCK_N-token tile (_attend_tile) it unpacks the 2/3/4/8-bit codes in registers,
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

from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

from ...options.schedule import OTT
from ...layout import LayerTensors, QuantParams
from ..reference.packing import codes_per_word
from .attend import (
    LOG2E, _cast, _cast_sat, _code_values, _in_pool, _load_pool_positions, _quantized_counts, _rope_cos_sin,
    attend_setup, attend_num_splits, launch_reduce, split_workspace,
)
from .args import KiviCache, Levels, Pool, Rope, Sparse, kernel_options
from .paging import Pages, cache_row, paging_args
from .quant import device_ctx, interpreting, load_words, next_pow2, unpack_codes

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


class SplitLayout(NamedTuple):
    """The split kernel's compile-time shape: head_dim D (D_P padded), its RoPE halves HD (HD_P
    padded to tl.dot's K >= 16), codes per byte K_PER / V_PER at K_BITS / V_BITS, key groups of G
    tokens (NGB scale rows per tile), NGV value groups (NGV_P x GV_P = D_P padded), the residual
    ring of R tokens (RR rows stored), QG query heads per kv head, BLOCK_M x BLOCK_N tiles."""
    D: object
    D_P: object
    HD: object
    HD_P: object
    K_BITS: object
    K_PER: object
    V_BITS: object
    V_PER: object
    G: object
    NGB: object
    NGV: object
    NGV_P: object
    GV_P: object
    R: object
    RR: object
    QG: object
    BLOCK_M: object
    BLOCK_N: object
    NUM_SPLITS: object
    OTT: object  # OTT's flush policy (schedule.py): keys and values quantized [0, G * floor((L - R) / G))


class Products(NamedTuple):
    """How the tile products run: LOWP (fp16/bf16 operands on tensor cores) or fp32 (DOT_F32 at
    F32_PRECISION); EMULATE_RTNE: the interpreter's exact casts (_cast)."""
    LOWP: object
    DOT_F32: object
    F32_PRECISION: object
    EMULATE_RTNE: object


@triton.jit
def _key_tile(
    t, tm, t0, limit, nqk, row, bh64, NSG, cache, levels, sparse,
    C0: tl.constexpr, W: tl.constexpr, W_P: tl.constexpr, MIXED: tl.constexpr, CAST: tl.constexpr, lay,
    EMULATE_RTNE: tl.constexpr, pg,
):
    """Keys [BLOCK_N, W_P] of tokens t, channels [C0, C0 + W) (the whole head, or one RoPE half):
    per-channel groups of G tokens, one scale row per group; fp32, or rounded to the cache dtype
    when CAST. MIXED: per-token choice between the dequantized codes and the residual ring.
    SPARSE: the exact key outliers (per channel, NK per R-window: rows w * NK + j of k_sparse,
    token offsets in k_sparse_idx, -1 none) replace their dequantized entries. pg: the block table
    of a paged layer (triton_paging.py; row is already through it)."""
    k_codes, k_scale, k_zero, k_res = cache.k_codes, cache.k_scale, cache.k_zero, cache.k_res
    c = tl.arange(0, W_P)
    cmask = c < W
    if MIXED:
        kq = tm & (t < nqk)
    else:
        kq = tm
    jk = tl.arange(0, W_P // lay.K_PER)
    kb = load_words(k_codes + row[:, None] * (lay.D // lay.K_PER * (lay.K_PER * lay.K_BITS // 8))
                    + (C0 // lay.K_PER + jk)[None, :], lay.D // lay.K_PER, lay.K_BITS,
                    kq[:, None] & (jk < W // lay.K_PER)[None, :])
    kc = _code_values(tl.reshape(unpack_codes(kb, lay.K_BITS, lay.K_PER), [lay.BLOCK_N, W_P]), levels.k_levels,
                      levels.HAS_LEVELS)
    grow = t0 // lay.G + tl.arange(0, lay.NGB)  # the NGB scale rows this tile touches
    gm = ((grow * lay.G < limit) & (grow * lay.G < nqk))[:, None] & cmask[None, :]
    ks_off = cache_row(bh64, grow, NSG, pg, pg.PAGE // lay.G)[:, None] * lay.D + (C0 + c)[None, :]
    ks = tl.load(k_scale + ks_off, mask=gm, other=0.0).to(tl.float32)
    kz = tl.load(k_zero + ks_off, mask=gm, other=0.0).to(tl.float32)
    if lay.NGB > 1:
        ks = tl.reshape(tl.broadcast_to(ks[:, None, :], [lay.NGB, lay.BLOCK_N // lay.NGB, W_P]), [lay.BLOCK_N, W_P])
        kz = tl.reshape(tl.broadcast_to(kz[:, None, :], [lay.NGB, lay.BLOCK_N // lay.NGB, W_P]), [lay.BLOCK_N, W_P])
    kdq = kc * ks + kz
    if CAST:
        kdq = _cast_sat(kdq, k_res.dtype.element_ty, EMULATE_RTNE)
    if sparse.SPARSE:
        w = t // lay.R  # a tile may span windows (BLOCK_N > R)
        om = kq[:, None] & cmask[None, :]
        for j in range(sparse.NK):
            srow = ((bh64 * sparse.NKR + w * sparse.NK + j)[:, None]) * lay.D + (C0 + c)[None, :]
            exact = tl.load(sparse.k_sparse + srow, mask=om, other=0.0)
            off = tl.load(sparse.k_sparse_idx + srow, mask=om, other=-1).to(tl.int32)
            hit = (off >= 0) & ((w[:, None] * lay.R + off) == t[:, None]) & om
            kdq = tl.where(hit, exact.to(kdq.dtype), kdq)
    if MIXED:
        slot = (bh64 * lay.RR + (t % lay.RR)[:, None]) * lay.D + (C0 + c)[None, :]
        kres = tl.load(k_res + slot, mask=(tm & (t >= nqk))[:, None] & cmask[None, :], other=0.0)
        k = tl.where(kq[:, None], kdq, kres.to(kdq.dtype))
    else:
        k = kdq
    return k


@triton.jit
def _attend_tile(
    acc, m_i, l_i, query, t0, limit, nqk, nqv, pos, row_ok, pp, bh64, S, NSG, qk_scale, cache, levels, sparse,
    MIXED: tl.constexpr, HAS_POOL: tl.constexpr, ROPE: tl.constexpr, lay, prod, pg,
):
    """One online-softmax step over tokens [t0, t0 + BLOCK_N) (t0 a multiple of BLOCK_N), tokens
    >= limit masked. MIXED=False: every token is quantized for keys and values (no residual loads);
    MIXED=True: per-token choice between the dequantized codes and the residual ring. HAS_POOL:
    tokens at the pooled positions pp are masked (their exact copies come in _attend_pool_tile).
    HAS_LEVELS: codes stand for nuq levels. ROPE: keys are pre-RoPE; query = (q, q_hi, freq) is
    then the query's halves and inv_freq [HD_P], and keys are dequantized as halves, rotated to
    their positions t in fp32 and only then rounded for the products; otherwise q is the whole
    query."""
    q, q_hi, freq = query
    v_codes, v_scale, v_zero, v_res = cache.v_codes, cache.v_scale, cache.v_zero, cache.v_res
    DT = cache.k_res.dtype.element_ty
    t = t0 + tl.arange(0, lay.BLOCK_N)
    tm = t < limit
    d = tl.arange(0, lay.D_P)
    dmask = d < lay.D
    row = cache_row(bh64, t, S, pg, pg.PAGE)  # int64 token row of codes and value scales

    # ---- keys [BLOCK_N, D_P]
    if ROPE:
        k_lo = _key_tile(t, tm, t0, limit, nqk, row, bh64, NSG, cache, levels, sparse, 0, lay.HD, lay.HD_P, MIXED,
                         False, lay, prod.EMULATE_RTNE, pg)
        k_hi = _key_tile(t, tm, t0, limit, nqk, row, bh64, NSG, cache, levels, sparse, lay.HD, lay.HD, lay.HD_P,
                         MIXED, False, lay, prod.EMULATE_RTNE, pg)
        s = _rope_qk(q, q_hi, k_lo, k_hi, t, freq, DT, prod.LOWP, prod.DOT_F32, prod.F32_PRECISION, prod.EMULATE_RTNE)
    else:
        k = _key_tile(t, tm, t0, limit, nqk, row, bh64, NSG, cache, levels, sparse, 0, lay.D, lay.D_P, MIXED, prod.LOWP,
                      lay, prod.EMULATE_RTNE, pg)
        s = _qk_dot(q, k, prod.DOT_F32, prod.F32_PRECISION)

    visible = row_ok[:, None] & tm[None, :] & (t[None, :] <= pos[:, None])
    if HAS_POOL:
        visible = visible & ~_in_pool(t, pp)[None, :]
    p, alpha, m_new, l_i = _softmax_step(s, visible, m_i, l_i, qk_scale)

    # ---- values [BLOCK_N, D_P]: per-token groups of GV channels
    if MIXED:
        vq = tm & (t < nqv)
    else:
        vq = tm
    jv = tl.arange(0, lay.D_P // lay.V_PER)
    vb = load_words(v_codes + row[:, None] * (lay.D // lay.V_PER * (lay.V_PER * lay.V_BITS // 8)) + jv[None, :],
                    lay.D // lay.V_PER, lay.V_BITS, vq[:, None] & (jv < lay.D // lay.V_PER)[None, :])
    vc = _code_values(tl.reshape(unpack_codes(vb, lay.V_BITS, lay.V_PER), [lay.BLOCK_N, lay.D_P]), levels.v_levels,
                      levels.HAS_LEVELS)
    if lay.NGV == 1:
        vs = tl.load(v_scale + row, mask=vq, other=0.0).to(tl.float32)[:, None]
        vz = tl.load(v_zero + row, mask=vq, other=0.0).to(tl.float32)[:, None]
    else:
        gi = tl.arange(0, lay.NGV_P)
        vs_off = row[:, None] * lay.NGV + gi[None, :]
        vm = vq[:, None] & (gi < lay.NGV)[None, :]
        vs = tl.load(v_scale + vs_off, mask=vm, other=0.0).to(tl.float32)
        vz = tl.load(v_zero + vs_off, mask=vm, other=0.0).to(tl.float32)
        vs = tl.reshape(tl.broadcast_to(vs[:, :, None], [lay.BLOCK_N, lay.NGV_P, lay.GV_P]), [lay.BLOCK_N, lay.D_P])
        vz = tl.reshape(tl.broadcast_to(vz[:, :, None], [lay.BLOCK_N, lay.NGV_P, lay.GV_P]), [lay.BLOCK_N, lay.D_P])
    vdq = vc * vs + vz
    if prod.LOWP:
        vdq = _cast_sat(vdq, DT, prod.EMULATE_RTNE)
    if sparse.SPARSE:  # per token, the NV exact value outliers (channels in v_sparse_idx, -1 none)
        for j in range(sparse.NV):
            exact = tl.load(sparse.v_sparse + row * sparse.NV + j, mask=vq, other=0.0)
            vch = tl.load(sparse.v_sparse_idx + row * sparse.NV + j, mask=vq, other=-1).to(tl.int32)
            vdq = tl.where(d[None, :] == vch[:, None], exact.to(vdq.dtype)[:, None], vdq)
    if MIXED:
        slot = (bh64 * lay.RR + (t % lay.RR)[:, None]) * lay.D + d[None, :]
        vres = tl.load(v_res + slot, mask=(tm & (t >= nqv))[:, None] & dmask[None, :], other=0.0)
        v = tl.where(vq[:, None], vdq, vres.to(vdq.dtype))
    else:
        v = vdq
    acc = _accumulate_pv(acc, alpha, p, v, DT, prod.LOWP, prod.DOT_F32, prod.F32_PRECISION, prod.EMULATE_RTNE)
    return acc, m_new, l_i


@triton.jit
def _attend_pool_tile(acc, m_i, l_i, query, j0, pos, row_ok, bh64, qk_scale, pool, ROPE: tl.constexpr, lay, prod):
    """One online-softmax step over pool slots [j0, j0 + BLOCK_N): exact keys/values (cache dtype),
    each visible to the real query rows at or after its token's position; empty slots (-1) to none.
    ROPE: pre-RoPE pool keys, rotated to their pool_pos (query: the halves, _attend_tile)."""
    q, q_hi, freq = query
    pool_k, pool_v = pool.pool_k, pool.pool_v
    j = j0 + tl.arange(0, lay.BLOCK_N)
    jm = j < pool.P
    ppos = tl.load(pool.pool_pos + bh64 * pool.P + j, mask=jm, other=-1)
    d = tl.arange(0, lay.D_P)
    off = (bh64 * pool.P + j)[:, None] * lay.D + d[None, :]
    m2 = jm[:, None] & (d < lay.D)[None, :]
    if ROPE:
        c = tl.arange(0, lay.HD_P)
        half = (bh64 * pool.P + j)[:, None] * lay.D + c[None, :]
        hm = jm[:, None] & (c < lay.HD)[None, :]
        k_lo = tl.load(pool_k + half, mask=hm, other=0.0).to(tl.float32)
        k_hi = tl.load(pool_k + half + lay.HD, mask=hm, other=0.0).to(tl.float32)
        s = _rope_qk(q, q_hi, k_lo, k_hi, ppos, freq, pool_k.dtype.element_ty, prod.LOWP, prod.DOT_F32, prod.F32_PRECISION,
                     prod.EMULATE_RTNE)
    else:
        k = tl.load(pool_k + off, mask=m2, other=0.0)
        s = _qk_dot(q, k, prod.DOT_F32, prod.F32_PRECISION)
    visible = row_ok[:, None] & (ppos >= 0)[None, :] & (ppos[None, :] <= pos[:, None])
    p, alpha, m_new, l_i = _softmax_step(s, visible, m_i, l_i, qk_scale)
    v = tl.load(pool_v + off, mask=m2, other=0.0)
    acc = _accumulate_pv(acc, alpha, p, v, pool_v.dtype.element_ty, prod.LOWP, prod.DOT_F32, prod.F32_PRECISION, prod.EMULATE_RTNE)
    return acc, m_new, l_i


@triton.jit
def _attend_split(
    q_ptr, s_qb, s_qh, s_qm, s_qd, cache, lengths_ptr, counts_ptr, HAS_COUNTS: tl.constexpr, pool, levels, rope,
    sparse, workspace, out_ptr, H, S, NSG, Q_LEN, M, M_PAD, qk_scale, lay, prod, pg,
):
    """_attend_split_kernel's body, its arguments grouped (triton_args.py)."""
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
    nqk, nqv = _quantized_counts(L, lay.R, lay.G, lay.OTT)

    # Query rows of this kv head: r = g * Q_LEN + i -> head h*QG + g, query i at position L - c + i.
    r = tl.program_id(1) * lay.BLOCK_M + tl.arange(0, lay.BLOCK_M)
    rmask = r < M
    gq = r // Q_LEN
    iq = r % Q_LEN
    pos = L - c + iq
    row_ok = rmask & (iq < c)
    d = tl.arange(0, lay.D_P)
    dmask = d < lay.D
    q_row = b.to(tl.int64) * s_qb + (h * lay.QG + gq).to(tl.int64)[:, None] * s_qh + iq.to(tl.int64)[:, None] * s_qm
    q_dt = tl.float32 if prod.DOT_F32 else cache.k_res.dtype.element_ty
    if rope.ROPE:
        # Pre-RoPE keys are rotated in halves (_rope_qk): the query as its two halves too, and the
        # frequencies once per program.
        c = tl.arange(0, lay.HD_P)
        hm = rmask[:, None] & (c < lay.HD)[None, :]
        q = tl.load(q_ptr + q_row + c.to(tl.int64)[None, :] * s_qd, mask=hm, other=0.0).to(q_dt)
        q_hi = tl.load(q_ptr + q_row + (lay.HD + c).to(tl.int64)[None, :] * s_qd, mask=hm, other=0.0).to(q_dt)
        freq = tl.load(rope.inv_freq + c, mask=c < lay.HD, other=0.0)
    else:
        q = tl.load(q_ptr + q_row + d.to(tl.int64)[None, :] * s_qd, mask=rmask[:, None] & dmask[None, :],
                    other=0.0).to(q_dt)
        q_hi = q  # unused
        freq = tl.zeros([lay.HD_P], tl.float32)  # unused
    query = (q, q_hi, freq)

    # This split's token range, cut from the sequence's own length (balanced for any L) in
    # whole BLOCK_N tiles, so every tile starts at a multiple of BLOCK_N.
    split_len = tl.cdiv(tl.cdiv(L, lay.NUM_SPLITS), lay.BLOCK_N) * lay.BLOCK_N
    lo = sp * split_len
    hi = tl.minimum(lo + split_len, L)
    # Tiles below `mid` are quantized for keys and values alike (the long, hot part); the last
    # <= R + BLOCK_N tokens go through the mixed path that also reads the residual rings.
    mid = tl.maximum(tl.minimum((tl.minimum(nqk, nqv) // lay.BLOCK_N) * lay.BLOCK_N, hi), lo)

    pp = _load_pool_positions(pool.pool_pos, bh64, pool.P, pool.P_P, pool.HAS_POOL)
    m_i = tl.full([lay.BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([lay.BLOCK_M], tl.float32)
    acc = tl.zeros([lay.BLOCK_M, lay.D_P], tl.float32)
    for t0 in range(lo, mid, lay.BLOCK_N):
        acc, m_i, l_i = _attend_tile(acc, m_i, l_i, query, t0, mid, nqk, nqv, pos, row_ok, pp, bh64, S, NSG, qk_scale,
                                     cache, levels, sparse, False, pool.HAS_POOL, rope.ROPE, lay, prod, pg)
    for t0 in range(mid, hi, lay.BLOCK_N):
        acc, m_i, l_i = _attend_tile(acc, m_i, l_i, query, t0, hi, nqk, nqv, pos, row_ok, pp, bh64, S, NSG, qk_scale,
                                     cache, levels, sparse, True, pool.HAS_POOL, rope.ROPE, lay, prod, pg)
    if pool.HAS_POOL:
        # Split 0 also takes the pool's exact tokens; the reduce kernel merges them like any split.
        for j0 in range(0, tl.where(sp == 0, pool.P, 0), lay.BLOCK_N):
            acc, m_i, l_i = _attend_pool_tile(acc, m_i, l_i, query, j0, pos, row_ok, bh64, qk_scale, pool, rope.ROPE,
                                              lay, prod)

    if lay.NUM_SPLITS == 1:
        o = tl.math.div_rn(acc, tl.zeros_like(acc) + tl.where(l_i > 0.0, l_i, 1.0)[:, None])
        o = tl.where((l_i > 0.0)[:, None], o, 0.0)
        o_off = (bh64 * M + r[:, None]) * lay.D + d[None, :]
        tl.store(out_ptr + o_off, _cast_sat(o, out_ptr.dtype.element_ty, prod.EMULATE_RTNE),
                 mask=rmask[:, None] & dmask[None, :])
    else:
        ws_m, ws_l, ws_acc = workspace
        w = (bh64 * lay.NUM_SPLITS + sp) * M_PAD + r
        tl.store(ws_m + w, m_i)
        tl.store(ws_l + w, l_i)
        tl.store(ws_acc + w[:, None] * lay.D + d[None, :], acc, mask=dmask[None, :])


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
    SPARSE: tl.constexpr, NK: tl.constexpr, NV: tl.constexpr, OTT: tl.constexpr,
    block_table, MAXP, NPAGES, PAGE: tl.constexpr, PAGED: tl.constexpr,
):
    """The launched entry point: flat arguments (triton_args.py), grouped for _attend_split."""
    _attend_split(
        q_ptr, s_qb, s_qh, s_qm, s_qd, KiviCache(k_codes, k_scale, k_zero, k_res, v_codes, v_scale, v_zero, v_res),
        lengths_ptr, counts_ptr, HAS_COUNTS, Pool(pool_k, pool_v, pool_pos, P, HAS_POOL, P_P),
        Levels(k_levels, v_levels, HAS_LEVELS), Rope(rope_inv_freq, ROPE),
        Sparse(k_sparse, k_sparse_idx, v_sparse, v_sparse_idx, NKR, NK, NV, SPARSE), (ws_m, ws_l, ws_acc), out_ptr,
        H, S, NSG, Q_LEN, M, M_PAD, qk_scale,
        SplitLayout(D, D_P, HD, HD_P, K_BITS, K_PER, V_BITS, V_PER, G, NGB, NGV, NGV_P, GV_P, R, RR, QG, BLOCK_M,
                    BLOCK_N, NUM_SPLITS, OTT),
        Products(LOWP, DOT_F32, F32_PRECISION, EMULATE_RTNE), Pages(block_table, MAXP, NPAGES, H, PAGE, PAGED),
    )


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
    num_stages: int = 2, pages=None,
) -> torch.Tensor:
    """Attention of query [B, Hq, q, D] over the cache, like attend_reference (module doc); any
    q_len, head_dim >= 16. The pool (t.pool) and KVQuant's nuq levels, pre-RoPE keys and sparse
    outlier store (t.extras) are read by the kernel.
    num_splits / block_n / num_warps / num_stages override the static choices (tests, tuning).
    pages: the layer is paged (paged_layout.Paging; its quantized buffers are page pools)."""
    (B, H, S, D, R, RR, G, gv), options, out = attend_setup(query, t, p, pages)
    if out.numel() == 0:
        return out
    k_codes, k_scale, k_zero, k_res, v_codes, v_scale, v_zero, v_res, lengths = t.kivi
    k_bits, v_bits = p.k_bits, p.v_bits
    Hq, q_len = query.shape[1], query.shape[2]
    QG = Hq // H
    M = QG * q_len
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
        block_n = max(16, default_block_n // 2) if options["SPARSE"] else default_block_n
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
    ws_m, ws_l, ws_acc = split_workspace(B * H, num_splits, m_pad, D, out)
    with device_ctx(query):
        torch.library.wrap_triton(_attend_split_kernel)[(B * H, m_blocks, num_splits)](
            query, query.stride(0), query.stride(1), query.stride(2), query.stride(3),
            k_codes, k_scale, k_zero, k_res, v_codes, v_scale, v_zero, v_res, lengths,
            counts if has_counts else lengths,
            ws_m=ws_m, ws_l=ws_l, ws_acc=ws_acc, out_ptr=out, H=H, S=S, Q_LEN=q_len, M=M,
            M_PAD=m_pad, qk_scale=float(scale) * LOG2E, HAS_COUNTS=has_counts,
            NSG=k_scale.shape[2] if pages is None else S // G, **paging_args(pages, t, G),
            # pre-RoPE halves padded to tl.dot's K >= 16 (zero channels add nothing)
            QG=QG, D=D, D_P=d_p, HD=D // 2, HD_P=max(16, next_pow2(D // 2)),
            K_BITS=k_bits, K_PER=codes_per_word(k_bits), V_BITS=v_bits, V_PER=codes_per_word(v_bits),
            G=G, NGB=max(block_n // G, 1), NGV=ngv, NGV_P=ngv_p, GV_P=gv_p,
            R=R, RR=RR, BLOCK_M=block_m, BLOCK_N=block_n, NUM_SPLITS=num_splits,
            LOWP=lowp, DOT_F32=dot_f32, F32_PRECISION=F32_DOT_PRECISION, EMULATE_RTNE=interp, OTT=p.flush_policy == OTT,
            **kernel_options(_attend_split_kernel, options), num_warps=num_warps, num_stages=num_stages,
        )
        if num_splits > 1:
            launch_reduce(ws_m, ws_l, ws_acc, out, B * H, M, m_pad, num_splits)
    return out
