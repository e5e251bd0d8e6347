"""Triton decode attention (q_len == 1, power-of-two head_dim): attend_decode; shared machinery in
attend.py. One program per (row, query head, split), per element in fp32 registers with no
tl.dot (a one-row query padded to a tensor-core tile costs more in layout shuffles, docs/performance.md).
A code tile is [PER, BLOCK_N, D // PER]: (i, t, j) is channel j * PER + i of token t."""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

from ...options.schedule import OTT
from ...layout import LayerTensors, QuantParams
from ..reference.packing import codes_per_word
from .attend import (
    LOG2E, _cast_sat, _code_values, _in_pool, _load_pool_positions, _quantized_counts, _rope_cos_sin,
    attend_setup, attend_num_splits, launch_reduce, split_workspace,
)
from .args import KiviCache, Levels, Pool, Rope, Sparse, kernel_options
from .paging import Pages, cache_row, paging_args
from .quant import device_ctx, interpreting, load_words

# 1 warp x 32 timed fastest (it spills); the sparse path and wide heads take the no-spill launch
# (docs/performance.md).
DECODE_BLOCK_N = 32
DECODE_PROGRAMS_PER_SM = 16
DECODE_NUM_WARPS = 1
NO_SPILL_DECODE_BLOCK_N = 16
NO_SPILL_DECODE_NUM_WARPS = 4
WIDEST_TIMED_HEAD_DIM = 128


def decode_launch_config(head_dim: int, sparse: bool) -> tuple[int, int]:
    if sparse or head_dim > WIDEST_TIMED_HEAD_DIM:
        return NO_SPILL_DECODE_BLOCK_N, NO_SPILL_DECODE_NUM_WARPS
    return DECODE_BLOCK_N, DECODE_NUM_WARPS


@triton.jit
def _decode_softmax_step(s, m_i, l_i, SAFE: tl.constexpr):
    """Base-2 online softmax step: (p, rescale, new max, new sum). SAFE: s may be all -inf while the
    max still is (pooled tokens, empty pool slots); without a pool the plain form."""
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
    """Scores [T] of q2 [PER, NB] against keys k [PER, T, NB]. ROPE: the query is rotated back per token,
    q . R_t k = (R_t^T q) . k, since a key's partner channel lies in another part of the tile."""
    if ROPE:
        cos, sin = _rope_cos_sin(positions[None, :, None], freq[:, None, :])
        q = q2[:, None, :] * cos - q2_rot[:, None, :] * sin
    else:
        q = q2[:, None, :]
    return tl.sum(tl.sum(q * k, axis=2), axis=0)


class DecodeLayout(NamedTuple):
    """The decode kernel's compile-time shape."""
    D: object
    K_BITS: object
    K_PER: object
    V_BITS: object
    V_PER: object
    G: object
    NGV: object
    GV: object
    R: object
    RR: object
    QG: object
    BLOCK_N: object
    NUM_SPLITS: object
    OTT: object


@triton.jit
def _decode_tile(
    acc, accz, m_i, l_i, query, t0, limit, nqk, nqv, pp, bh64, S, NSG, cache, levels, sparse,
    MIXED: tl.constexpr, HAS_POOL: tl.constexpr, ROPE: tl.constexpr, lay, pg,
):
    """One online-softmax step over tokens [t0, t0 + BLOCK_N), within one key group (BLOCK_N divides G).
    MIXED=False: all quantized, nothing masked, key scale/zero folded into the query
    (q.(c*s + z) = (q*s).c + q.z); with ROPE the keys are dequantized instead."""
    k_codes, k_scale, k_zero, k_res, v_codes, v_scale, v_zero, v_res = cache
    q2, q2_rot, freq = query
    t = t0 + tl.arange(0, lay.BLOCK_N)
    row = cache_row(bh64, t, S, pg, pg.PAGE)
    g = t0 // lay.G

    ik = tl.arange(0, lay.K_PER)
    jk = tl.arange(0, lay.D // lay.K_PER)
    ch_k = jk[None, :] * lay.K_PER + ik[:, None]
    k_off = (row[:, None] * (lay.D // lay.K_PER * (lay.K_PER * lay.K_BITS // 8)) + jk[None, :])[None, :, :]
    ks_off = cache_row(bh64, g, NSG, pg, pg.PAGE // lay.G) * lay.D + ch_k
    sh_k = (ik * lay.K_BITS)[:, None, None]
    if MIXED:
        tm = t < limit
        kq = tm & (t < nqk)
        kb = load_words(k_codes + k_off, lay.D // lay.K_PER, lay.K_BITS, kq[None, :, None])
        gq = g * lay.G < nqk
        ks = tl.load(k_scale + ks_off, mask=gq, other=0.0).to(tl.float32)
        kz = tl.load(k_zero + ks_off, mask=gq, other=0.0).to(tl.float32)
        kc = _code_values((kb.to(tl.int32) >> sh_k) & ((1 << lay.K_BITS) - 1), levels.k_levels, levels.HAS_LEVELS)
        kdq = kc * ks[:, None, :] + kz[:, None, :]
        slot = (bh64 * lay.RR + t % lay.RR)[None, :, None] * lay.D + ch_k[:, None, :]
        kres = tl.load(k_res + slot, mask=(tm & (t >= nqk))[None, :, None], other=0.0).to(tl.float32)
        k = tl.where(kq[None, :, None], kdq, kres)
        if sparse.SPARSE:
            k = _decode_key_outliers(k, t, t0, kq, nqk, ch_k, bh64, sparse, lay)
        s = _decode_scores(q2, q2_rot, freq, t, k, ROPE)
        s = tl.where(tm, s, float("-inf"))
    else:
        kb = load_words(k_codes + k_off, lay.D // lay.K_PER, lay.K_BITS, None)
        ks = tl.load(k_scale + ks_off).to(tl.float32)
        kz = tl.load(k_zero + ks_off).to(tl.float32)
        kc = _code_values((kb.to(tl.int32) >> sh_k) & ((1 << lay.K_BITS) - 1), levels.k_levels, levels.HAS_LEVELS)
        if ROPE:
            s = _decode_scores(q2, q2_rot, freq, t, kc * ks[:, None, :] + kz[:, None, :], ROPE)
        else:
            s = (tl.sum(tl.sum((q2 * ks)[:, None, :] * kc, axis=2), axis=0)
                 + tl.sum(tl.sum(q2 * kz, axis=1), axis=0))
    if HAS_POOL:
        s = tl.where(_in_pool(t, pp), float("-inf"), s)
    p, alpha, m_new, l_i = _decode_softmax_step(s, m_i, l_i, HAS_POOL)

    iv = tl.arange(0, lay.V_PER)
    jv = tl.arange(0, lay.D // lay.V_PER)
    v_off = (row[:, None] * (lay.D // lay.V_PER * (lay.V_PER * lay.V_BITS // 8)) + jv[None, :])[None, :, :]
    vs_off = row[:, None] * lay.NGV + (jv * lay.V_PER // lay.GV)[None, :]
    sh_v = (iv * lay.V_BITS)[:, None, None]
    if MIXED:
        vq = tm & (t < nqv)
        vb = load_words(v_codes + v_off, lay.D // lay.V_PER, lay.V_BITS, vq[None, :, None])
        vs = tl.load(v_scale + vs_off, mask=vq[:, None], other=0.0).to(tl.float32)
        vz = tl.load(v_zero + vs_off, mask=vq[:, None], other=0.0).to(tl.float32)
        vc = _code_values((vb.to(tl.int32) >> sh_v) & ((1 << lay.V_BITS) - 1), levels.v_levels, levels.HAS_LEVELS)
        vdq = vc * vs[None, :, :] + vz[None, :, :]
        ch_v = jv[None, :] * lay.V_PER + iv[:, None]
        slot = (bh64 * lay.RR + t % lay.RR)[None, :, None] * lay.D + ch_v[:, None, :]
        vres = tl.load(v_res + slot, mask=(tm & (t >= nqv))[None, :, None], other=0.0).to(tl.float32)
        v = tl.where(vq[None, :, None], vdq, vres)
        if sparse.SPARSE:
            v = _decode_value_outliers(v, t, vq, ch_v, bh64, S, sparse)
        acc = acc * alpha + p[None, :, None] * v
        accz = accz * alpha  # the zero term sum_t p_t z_t, which has no code axis
    else:
        vb = load_words(v_codes + v_off, lay.D // lay.V_PER, lay.V_BITS, None)
        vs = tl.load(v_scale + vs_off).to(tl.float32)
        vz = tl.load(v_zero + vs_off).to(tl.float32)
        vc = _code_values((vb.to(tl.int32) >> sh_v) & ((1 << lay.V_BITS) - 1), levels.v_levels, levels.HAS_LEVELS)
        acc = acc * alpha + (p[:, None] * vs)[None, :, :] * vc
        accz = accz * alpha + tl.sum(p[:, None] * vz, axis=0)
    return acc, accz, m_new, l_i


@triton.jit
def _decode_key_outliers(k, t, t0, kq, nqk, ch_k, bh64, sparse, lay):
    """Keys k [K_PER, BLOCK_N, NBK] with the window's exact key outliers written over them."""
    w = t0 // lay.R
    flushed = w * lay.R < nqk
    for j in range(sparse.NK):
        srow = (bh64 * sparse.NKR + w * sparse.NK + j) * lay.D + ch_k  # [K_PER, NBK]
        exact = tl.load(sparse.k_sparse + srow, mask=flushed, other=0.0).to(tl.float32)
        off = tl.load(sparse.k_sparse_idx + srow, mask=flushed, other=-1).to(tl.int32)
        hit = ((w * lay.R + off)[:, None, :] == t[None, :, None]) & (off >= 0)[:, None, :] & kq[None, :, None]
        k = tl.where(hit, exact[:, None, :], k)
    return k


@triton.jit
def _decode_value_outliers(v, t, vq, ch_v, bh64, S, sparse):
    """Values v [V_PER, BLOCK_N, NBV] with each token's exact outliers written over them."""
    for j in range(sparse.NV):
        voff = (bh64 * S + t) * sparse.NV + j
        exact = tl.load(sparse.v_sparse + voff, mask=vq, other=0.0).to(tl.float32)
        vch = tl.load(sparse.v_sparse_idx + voff, mask=vq, other=-1).to(tl.int32)
        v = tl.where(ch_v[:, None, :] == vch[None, :, None], exact[None, :, None], v)
    return v


@triton.jit
def _decode_pool_tile(acc, accz, m_i, l_i, query, j0, bh64, pool, ROPE: tl.constexpr, lay):
    """One online-softmax step over pool slots [j0, j0 + BLOCK_N); every filled slot is visible."""
    q2, q2_rot, freq = query
    j = j0 + tl.arange(0, lay.BLOCK_N)
    jm = j < pool.P
    ppos = tl.load(pool.pool_pos + bh64 * pool.P + j, mask=jm, other=-1)
    filled = ppos >= 0
    row = bh64 * pool.P + j
    ik = tl.arange(0, lay.K_PER)
    jk = tl.arange(0, lay.D // lay.K_PER)
    ch_k = jk[None, :] * lay.K_PER + ik[:, None]
    k = tl.load(pool.pool_k + row[None, :, None] * lay.D + ch_k[:, None, :], mask=jm[None, :, None], other=0.0)
    s = _decode_scores(q2, q2_rot, freq, ppos, k.to(tl.float32), ROPE)
    s = tl.where(filled, s, float("-inf"))
    p, alpha, m_new, l_i = _decode_softmax_step(s, m_i, l_i, True)
    iv = tl.arange(0, lay.V_PER)
    jv = tl.arange(0, lay.D // lay.V_PER)
    ch_v = jv[None, :] * lay.V_PER + iv[:, None]
    v = tl.load(pool.pool_v + row[None, :, None] * lay.D + ch_v[:, None, :], mask=jm[None, :, None], other=0.0)
    acc = acc * alpha + p[None, :, None] * v.to(tl.float32)
    accz = accz * alpha
    return acc, accz, m_new, l_i


@triton.jit
def _attend_decode(
    q_ptr, s_qb, s_qh, s_qd, cache, lengths_ptr, counts_ptr, HAS_COUNTS: tl.constexpr, pool, levels, rope, sparse,
    workspace, out_ptr, H, HQ, S, NSG, qk_scale, lay, EMULATE_RTNE: tl.constexpr, pg,
):
    pid = tl.program_id(0)
    sp = tl.program_id(1)
    b = pid // HQ
    hq = pid % HQ
    bh64 = (b * H + hq // lay.QG).to(tl.int64)
    L = tl.load(lengths_ptr + b).to(tl.int32)
    nqk, nqv = _quantized_counts(L, lay.R, lay.G, lay.OTT)
    # scale * log2(e) folded into the query.
    ik = tl.arange(0, lay.K_PER)
    jk = tl.arange(0, lay.D // lay.K_PER)
    ch_k = jk[None, :] * lay.K_PER + ik[:, None]
    q_row = q_ptr + b.to(tl.int64) * s_qb + hq.to(tl.int64) * s_qh
    q2 = tl.load(q_row + ch_k.to(tl.int64) * s_qd).to(tl.float32)
    q2 = q2 * qk_scale
    if rope.ROPE:
        partner = (ch_k + lay.D // 2) % lay.D
        q2_rot = tl.load(q_row + partner.to(tl.int64) * s_qd).to(tl.float32) * qk_scale
        q2_rot = tl.where(ch_k < lay.D // 2, -q2_rot, q2_rot)
        freq = tl.load(rope.inv_freq + ch_k % (lay.D // 2))
    else:
        q2_rot = q2
        freq = q2
    query = (q2, q2_rot, freq)

    split_len = tl.cdiv(tl.cdiv(L, lay.NUM_SPLITS), lay.BLOCK_N) * lay.BLOCK_N
    lo = sp * split_len
    hi = tl.minimum(lo + split_len, L)
    # Split 0 also takes the pool's tokens.
    pool_end = tl.where(sp == 0, pool.P, 0)
    if HAS_COUNTS:
        real = tl.load(counts_ptr + b) > 0
        hi = tl.where(real, hi, lo)
        pool_end = tl.where(real, pool_end, 0)
    mid = tl.maximum(tl.minimum((tl.minimum(nqk, nqv) // lay.BLOCK_N) * lay.BLOCK_N, hi), lo)
    if sparse.SPARSE:
        mid = lo

    pp = _load_pool_positions(pool.pool_pos, bh64, pool.P, pool.P_P, pool.HAS_POOL)
    m_i = tl.full([], float("-inf"), tl.float32)
    l_i = tl.zeros([], tl.float32)
    acc = tl.zeros([lay.V_PER, lay.BLOCK_N, lay.D // lay.V_PER], tl.float32)
    accz = tl.zeros([lay.D // lay.V_PER], tl.float32)
    for t0 in range(lo, mid, lay.BLOCK_N):
        acc, accz, m_i, l_i = _decode_tile(acc, accz, m_i, l_i, query, t0, mid, nqk, nqv, pp, bh64, S, NSG, cache,
                                           levels, sparse, False, pool.HAS_POOL, rope.ROPE, lay, pg)
    for t0 in range(mid, hi, lay.BLOCK_N):
        acc, accz, m_i, l_i = _decode_tile(acc, accz, m_i, l_i, query, t0, hi, nqk, nqv, pp, bh64, S, NSG, cache,
                                           levels, sparse, True, pool.HAS_POOL, rope.ROPE, lay, pg)
    if pool.HAS_POOL:
        for j0 in range(0, pool_end, lay.BLOCK_N):
            acc, accz, m_i, l_i = _decode_pool_tile(acc, accz, m_i, l_i, query, j0, bh64, pool, rope.ROPE, lay)

    iv = tl.arange(0, lay.V_PER)
    jv = tl.arange(0, lay.D // lay.V_PER)
    ch_v = jv[None, :] * lay.V_PER + iv[:, None]
    o = tl.sum(acc, axis=1) + accz[None, :]
    if lay.NUM_SPLITS == 1:
        o = tl.math.div_rn(o, tl.zeros_like(o) + tl.where(l_i > 0.0, l_i, 1.0))
        o = tl.where(l_i > 0.0, o, 0.0)
        tl.store(out_ptr + pid.to(tl.int64) * lay.D + ch_v, _cast_sat(o, out_ptr.dtype.element_ty, EMULATE_RTNE))
    else:
        ws_m, ws_l, ws_acc = workspace
        w = (bh64 * lay.NUM_SPLITS + sp) * lay.QG + hq % lay.QG
        tl.store(ws_m + w, m_i)
        tl.store(ws_l + w, l_i)
        tl.store(ws_acc + w * lay.D + ch_v, o)


@triton.jit
def _attend_decode_kernel(
    q_ptr, s_qb, s_qh, s_qd,
    k_codes, k_scale, k_zero, k_res, v_codes, v_scale, v_zero, v_res, lengths_ptr, counts_ptr,
    pool_k, pool_v, pool_pos, k_levels, v_levels, rope_inv_freq, ws_m, ws_l, ws_acc, out_ptr,
    k_sparse, k_sparse_idx, v_sparse, v_sparse_idx,
    H, HQ, S, NSG, P, NKR, qk_scale,
    HAS_COUNTS: tl.constexpr, HAS_POOL: tl.constexpr, P_P: tl.constexpr, HAS_LEVELS: tl.constexpr,
    ROPE: tl.constexpr, QG: tl.constexpr, D: tl.constexpr,
    K_BITS: tl.constexpr, K_PER: tl.constexpr, V_BITS: tl.constexpr, V_PER: tl.constexpr,
    G: tl.constexpr, NGV: tl.constexpr, GV: tl.constexpr, R: tl.constexpr, RR: tl.constexpr,
    BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr, EMULATE_RTNE: tl.constexpr,
    SPARSE: tl.constexpr, NK: tl.constexpr, NV: tl.constexpr, OTT: tl.constexpr,
    block_table, MAXP, NPAGES, PAGE: tl.constexpr, PAGED: tl.constexpr,
):
    _attend_decode(
        q_ptr, s_qb, s_qh, s_qd, KiviCache(k_codes, k_scale, k_zero, k_res, v_codes, v_scale, v_zero, v_res),
        lengths_ptr, counts_ptr, HAS_COUNTS, Pool(pool_k, pool_v, pool_pos, P, HAS_POOL, P_P),
        Levels(k_levels, v_levels, HAS_LEVELS), Rope(rope_inv_freq, ROPE),
        Sparse(k_sparse, k_sparse_idx, v_sparse, v_sparse_idx, NKR, NK, NV, SPARSE), (ws_m, ws_l, ws_acc), out_ptr,
        H, HQ, S, NSG, qk_scale,
        DecodeLayout(D, K_BITS, K_PER, V_BITS, V_PER, G, NGV, GV, R, RR, QG, BLOCK_N, NUM_SPLITS, OTT), EMULATE_RTNE,
        Pages(block_table, MAXP, NPAGES, H, PAGE, PAGED),
    )


def attend_decode(
    query: torch.Tensor, t: LayerTensors, counts: Optional[torch.Tensor], p: QuantParams, scale: float, *,
    num_splits: Optional[int] = None, block_n: Optional[int] = None, num_warps: Optional[int] = None,
    num_stages: int = 2, pages=None,
) -> torch.Tensor:
    """attend_reference for query [B, Hq, 1, D], D a power of two (else ValueError); the keyword
    arguments override the static launch choices (tests, tuning)."""
    (B, H, S, D, R, RR, G, gv), options, out = attend_setup(query, t, p, pages)
    Hq, q_len = query.shape[1], query.shape[2]
    if q_len != 1:
        raise ValueError(f"attend_decode takes one query per row (q_len == 1), got q_len={q_len}; "
                         f"attend_split takes any q_len")
    if D & (D - 1):
        raise ValueError(f"attend_decode needs a power-of-two head_dim, got {D}; attend_split takes any")
    if out.numel() == 0:
        return out
    k_codes, k_scale, k_zero, k_res, v_codes, v_scale, v_zero, v_res, lengths = t.kivi
    k_bits, v_bits = p.k_bits, p.v_bits
    sparse = options["SPARSE"]
    QG = Hq // H
    default_block_n, default_warps = decode_launch_config(D, sparse)
    block_n = min(block_n or default_block_n, G)
    num_splits = attend_num_splits(B * Hq, S, block_n, query.device, programs_per_sm=DECODE_PROGRAMS_PER_SM,
                                   requested=num_splits)
    if query.dtype != k_res.dtype:
        query = query.to(k_res.dtype)
    has_counts = counts is not None
    nsg = k_scale.shape[2] if pages is None else S // G
    ws_m, ws_l, ws_acc = split_workspace(B * H, num_splits, QG, D, out)
    with device_ctx(query):
        torch.library.wrap_triton(_attend_decode_kernel)[(B * Hq, num_splits)](
            query, query.stride(0), query.stride(1), query.stride(3),
            k_codes, k_scale, k_zero, k_res, v_codes, v_scale, v_zero, v_res, lengths,
            counts if has_counts else lengths,
            ws_m=ws_m, ws_l=ws_l, ws_acc=ws_acc, out_ptr=out, H=H, HQ=Hq, S=S, NSG=nsg,
            qk_scale=float(scale) * LOG2E, HAS_COUNTS=has_counts,
            **paging_args(pages, t, G),
            QG=QG, D=D, K_BITS=k_bits, K_PER=codes_per_word(k_bits),
            V_BITS=v_bits, V_PER=codes_per_word(v_bits), G=G, NGV=D // gv, GV=gv, R=R, RR=RR,
            BLOCK_N=block_n, NUM_SPLITS=num_splits, EMULATE_RTNE=interpreting(), OTT=p.flush_policy == OTT,
            **kernel_options(_attend_decode_kernel, options),
            num_warps=num_warps or default_warps,
            num_stages=num_stages,
        )
        if num_splits > 1:
            launch_reduce(ws_m, ws_l, ws_acc, out, B * H, QG, QG, num_splits)
    return out
