"""Triton split-K attention, any q_len (head_dim >= 16 for tl.dot): attend_split; shared machinery in
attend.py. One program per (kv head, BLOCK_M query rows, split): GQA without repeat_kv, row
r = g*q_len + i is query i of head h*Hq/H + g. fp16/bf16 products on tensor cores with operands rounded
to the cache dtype and saturated first (fp16 q * s + z can reach 65536), fp32 accumulation."""

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

# fp32 caches: "tf32x3" (~2^-22 relative per product) instead of "ieee" (~5x the FMAs, spills at D=128).
F32_DOT_PRECISION = "tf32x3"


@triton.jit
def _qk_dot(q, k, DOT_F32: tl.constexpr, F32_PRECISION: tl.constexpr):
    if DOT_F32:
        s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision=F32_PRECISION)
    else:
        s = tl.dot(q, tl.trans(k))
    return s


@triton.jit
def _softmax_step(s, visible, m_i, l_i, qk_scale):
    """Base-2 online softmax step, invisible entries masked: (p, rescale, new max, new sum)."""
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
    """Scores of pre-RoPE key halves rotated in fp32: halves need no channel shuffle, two tl.dot of D/2."""
    cos, sin = _rope_cos_sin(positions[:, None], freq[None, :])
    lo = k_lo * cos - k_hi * sin
    hi = k_hi * cos + k_lo * sin
    if LOWP:
        lo = _cast_sat(lo, DT, EMULATE_RTNE)
        hi = _cast_sat(hi, DT, EMULATE_RTNE)
    return _qk_dot(q_lo, lo, DOT_F32, F32_PRECISION) + _qk_dot(q_hi, hi, DOT_F32, F32_PRECISION)


class SplitLayout(NamedTuple):
    """The split kernel's compile-time shape (_P: padded to a power of two)."""
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
    OTT: object


class Products(NamedTuple):
    """LOWP (fp16/bf16 tensor cores) or fp32 at F32_PRECISION; EMULATE_RTNE: the interpreter's casts."""
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
    """Keys [BLOCK_N, W_P] of tokens t, channels [C0, C0 + W) (the head, or one RoPE half)."""
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
    grow = t0 // lay.G + tl.arange(0, lay.NGB)
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
        w = t // lay.R  # per token: a tile may span windows
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
    """One online-softmax step over tokens [t0, t0 + BLOCK_N), tokens >= limit masked. MIXED=False: all
    quantized, no residual loads. ROPE: keys rotated in fp32 before they are rounded for the products."""
    q, q_hi, freq = query
    v_codes, v_scale, v_zero, v_res = cache.v_codes, cache.v_scale, cache.v_zero, cache.v_res
    DT = cache.k_res.dtype.element_ty
    t = t0 + tl.arange(0, lay.BLOCK_N)
    tm = t < limit
    d = tl.arange(0, lay.D_P)
    dmask = d < lay.D
    row = cache_row(bh64, t, S, pg, pg.PAGE)

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
    if sparse.SPARSE:
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
    """One online-softmax step over pool slots [j0, j0 + BLOCK_N); empty slots (-1) visible to none."""
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
        c = tl.arange(0, lay.HD_P)
        hm = rmask[:, None] & (c < lay.HD)[None, :]
        q = tl.load(q_ptr + q_row + c.to(tl.int64)[None, :] * s_qd, mask=hm, other=0.0).to(q_dt)
        q_hi = tl.load(q_ptr + q_row + (lay.HD + c).to(tl.int64)[None, :] * s_qd, mask=hm, other=0.0).to(q_dt)
        freq = tl.load(rope.inv_freq + c, mask=c < lay.HD, other=0.0)
    else:
        q = tl.load(q_ptr + q_row + d.to(tl.int64)[None, :] * s_qd, mask=rmask[:, None] & dmask[None, :],
                    other=0.0).to(q_dt)
        q_hi = q
        freq = tl.zeros([lay.HD_P], tl.float32)
    query = (q, q_hi, freq)

    # Whole BLOCK_N tiles of the sequence's own length, so every tile starts at a multiple of BLOCK_N.
    split_len = tl.cdiv(tl.cdiv(L, lay.NUM_SPLITS), lay.BLOCK_N) * lay.BLOCK_N
    lo = sp * split_len
    hi = tl.minimum(lo + split_len, L)
    # Below `mid` all tokens are quantized; the last <= R + BLOCK_N take the mixed path.
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
        # Split 0 also takes the pool's tokens.
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
    """(BLOCK_M, BLOCK_N, num_warps) for `rows` query rows per kv head: chosen from sm_90 ptxas
    compiles, not timed: no spills, <= ~110 KB shared memory at num_stages=2."""
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
    """attend_reference for query [B, Hq, q, D], any q_len, head_dim >= 16; the keyword arguments
    override the static launch choices (tests, tuning)."""
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
        # Half-size tiles keep the outliers' rows free of spills on sm_90.
        block_n = max(16, default_block_n // 2) if options["SPARSE"] else default_block_n
    if block_n < 16 or block_n & (block_n - 1):
        raise ValueError(f"block_n must be a power of two >= 16, got {block_n}")
    ngv, ngv_p, gv_p = D // gv, next_pow2(D // gv), next_pow2(gv)
    assert ngv_p * gv_p == d_p, (D, gv)
    num_splits = attend_num_splits(B * H * m_blocks, S, block_n, query.device, requested=num_splits)
    dtype = k_res.dtype
    interp = interpreting()
    # The interpreter's tl.dot takes no bf16: rounded operands are upcast to fp32 (exact) there.
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
            # RoPE halves padded to tl.dot's K >= 16
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
