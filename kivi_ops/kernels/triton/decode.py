"""Triton decode attention over the KIVI cache (q_len == 1, power-of-two head_dim): attend_decode.

Layout and streaming policy: kivi_ops/layout.py; kernels/reference.py (attend_reference) is the
specification the kernel is tested against. What both attention kernels share (the split merge,
the pool and KVQuant options, CUDA-graph safety): triton_attend.py. The dispatcher (dispatch.py)
picks this kernel for decode steps whose head_dim is a power of two; every other call goes to the
split kernel (triton_split.py), which computes the same attention.

attend_decode:
  1. _attend_decode_kernel grid (B*Hq, num_splits): one program per (batch row, query head,
     split); the query heads of one kv head read the same codes (L2 hits). Everything is per
     element in fp32 registers, with no tl.dot and no reshapes: a decode query is one row, and
     padding it to a 16-row tensor-core tile cost more in layout shuffles through shared memory
     than the products themselves (measured on H100, see benchmarks/results). A code tile is
     [PER, BLOCK_N, D // PER] (element (i, t, j): channel j * PER + i of token t, the i-th code
     of byte j), so unpacking is a broadcast shift. BLOCK_N divides G, so a tile lies in one key
     group. Tiles below min(nqk, nqv) are quantized for keys and values alike: nothing is masked,
     the key scale/zero fold into the query (q . (c s + z) = (q s) . c + q . z) and the value
     zeros into a separate sum (sum_t p_t z_t); the last tokens take the mixed path that also
     reads the residual rings. num_splits comes from static shapes (DECODE_PROGRAMS_PER_SM
     programs per SM); the scale * log2(e) of the base-2 online softmax is folded into the query.
  2. _attend_reduce_kernel (triton_attend.py) grid (B*Hq,) when num_splits > 1.
  With the pool, split 0 runs the P pool slots in the same layout (_decode_pool_tile); every
  filled slot is visible (pooled tokens are stored tokens, all at or before the decode query).
  Pre-RoPE keys (ROPE): the query is rotated back per token instead of rotating the keys
  (q . R_t k = (R_t^T q) . k, _decode_scores), which needs no partner channel of the key tile,
  so the key scales no longer fold into the query.
  A padded row (counts 0) attends to nothing and returns 0. The query is cast to the cache dtype
  (then used in fp32); the output has the query's dtype, saturated to its finite range
  (packing.py's rule; keys/values stay fp32, unsaturated, like the reference's packed domain).
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
    LOG2E, _cast_sat, _code_values, _in_pool, _load_pool_positions, _quantized_counts, _rope_cos_sin,
    attend_setup, attend_num_splits, launch_reduce, split_workspace,
)
from .args import KiviCache, Levels, Pool, Rope, Sparse, kernel_options
from .paging import Pages, cache_row, paging_args
from .quant import device_ctx, interpreting, load_words

# Launch defaults: 1 warp x 32-token tiles timed fastest on the H100 among 1, 2 and 4 warps x 32
# tokens (docs/performance.md), although ptxas reports 255 registers and up to 1.8 KB of spills per
# thread at head_dim 128 (results/ptxas_sm90.json). 4 warps x 16 tokens (64-113 registers, no
# spills) was never timed: lab/gpu_suite.sh's sweep compares them. The sparse store's path
# (every tile mixed, never timed either) takes the no-spill configuration: 56-114 registers.
# At head_dim 256 (Gemma) that default spills 9.5 KB (KIVI-2) to 14 KB (KIVI-4) per thread, and
# 4 warps x 16 tokens compiles to 167-200 registers with none (results/ptxas_sm90.json): wide heads
# take the no-spill configuration too, untimed like the sparse path.
DECODE_BLOCK_N = 32
DECODE_PROGRAMS_PER_SM = 16
DECODE_NUM_WARPS = 1
NO_SPILL_DECODE_BLOCK_N = 16
NO_SPILL_DECODE_NUM_WARPS = 4
WIDEST_TIMED_HEAD_DIM = 128


def decode_launch_config(head_dim: int, sparse: bool) -> tuple[int, int]:
    """(BLOCK_N, num_warps) of the decode kernel by default (see the comments above)."""
    if sparse or head_dim > WIDEST_TIMED_HEAD_DIM:
        return NO_SPILL_DECODE_BLOCK_N, NO_SPILL_DECODE_NUM_WARPS
    return DECODE_BLOCK_N, DECODE_NUM_WARPS


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


class DecodeLayout(NamedTuple):
    """The decode kernel's compile-time shape: head_dim D, codes per packed word K_PER / V_PER at K_BITS /
    V_BITS, key groups of G tokens, NGV value groups of GV channels, the residual ring of R
    tokens (RR rows stored), QG query heads per kv head, BLOCK_N tokens per tile."""
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
    OTT: object  # OTT's flush policy (schedule.py): keys and values quantized [0, G * floor((L - R) / G))


@triton.jit
def _decode_tile(
    acc, accz, m_i, l_i, query, t0, limit, nqk, nqv, pp, bh64, S, NSG, cache, levels, sparse,
    MIXED: tl.constexpr, HAS_POOL: tl.constexpr, ROPE: tl.constexpr, lay, pg,
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
    for the tile: the keys are dequantized, not folded into the query. SPARSE (MIXED tiles only):
    the dense-and-sparse store's exact entries replace their dequantized ones in the tile: per
    channel, the NK key outliers of the tile's R-window (rows w * NK + j of k_sparse, token offsets
    in k_sparse_idx), and per token the NV value outliers (channels in v_sparse_idx); -1 is none.
    query: (q2, q2_rot, freq) of _attend_decode. pg: the block table of a paged layer
    (triton_paging.py; off: the static rows)."""
    k_codes, k_scale, k_zero, k_res, v_codes, v_scale, v_zero, v_res = cache
    q2, q2_rot, freq = query
    t = t0 + tl.arange(0, lay.BLOCK_N)
    row = cache_row(bh64, t, S, pg, pg.PAGE)  # int64 token row of codes and value scales
    g = t0 // lay.G

    # ---- keys
    ik = tl.arange(0, lay.K_PER)
    jk = tl.arange(0, lay.D // lay.K_PER)
    ch_k = jk[None, :] * lay.K_PER + ik[:, None]  # [K_PER, NBK] channel of (i, j)
    # word j of a token's packed row (3-bit: three byte planes, load_words)
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

    # ---- values: per-token scale/zero of the GV-channel group of byte j (GV is a multiple of V_PER)
    iv = tl.arange(0, lay.V_PER)
    jv = tl.arange(0, lay.D // lay.V_PER)
    v_off = (row[:, None] * (lay.D // lay.V_PER * (lay.V_PER * lay.V_BITS // 8)) + jv[None, :])[None, :, :]
    vs_off = row[:, None] * lay.NGV + (jv * lay.V_PER // lay.GV)[None, :]  # [BLOCK_N, NBV]
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
        accz = accz * alpha  # [NBV]: the zero-point term sum_t p_t z_t of the fast tiles
    else:
        vb = load_words(v_codes + v_off, lay.D // lay.V_PER, lay.V_BITS, None)
        vs = tl.load(v_scale + vs_off).to(tl.float32)
        vz = tl.load(v_zero + vs_off).to(tl.float32)
        vc = _code_values((vb.to(tl.int32) >> sh_v) & ((1 << lay.V_BITS) - 1), levels.v_levels, levels.HAS_LEVELS)
        # sum_t p_t (c s + z) = sum_t (p_t s) c + sum_t p_t z: the zero term has no code axis
        acc = acc * alpha + (p[:, None] * vs)[None, :, :] * vc
        accz = accz * alpha + tl.sum(p[:, None] * vz, axis=0)
    return acc, accz, m_new, l_i


@triton.jit
def _decode_key_outliers(k, t, t0, kq, nqk, ch_k, bh64, sparse, lay):
    """The keys k [K_PER, BLOCK_N, NBK] of a MIXED tile with the sparse store's exact entries
    written over their dequantized ones: per channel, the NK outliers of the tile's R-window (rows
    w * NK + j of k_sparse, token offsets in k_sparse_idx, -1 none)."""
    w = t0 // lay.R  # the tile lies in one window (BLOCK_N divides G, G divides R)
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
    """The values v [V_PER, BLOCK_N, NBV] of a MIXED tile with each token's NV exact outliers
    (channels in v_sparse_idx, -1 none) written over their dequantized entries."""
    for j in range(sparse.NV):
        voff = (bh64 * S + t) * sparse.NV + j  # [BLOCK_N]
        exact = tl.load(sparse.v_sparse + voff, mask=vq, other=0.0).to(tl.float32)
        vch = tl.load(sparse.v_sparse_idx + voff, mask=vq, other=-1).to(tl.int32)
        v = tl.where(ch_v[:, None, :] == vch[None, :, None], exact[None, :, None], v)
    return v


@triton.jit
def _decode_pool_tile(acc, accz, m_i, l_i, query, j0, bh64, pool, ROPE: tl.constexpr, lay):
    """One online-softmax step of one query over pool slots [j0, j0 + BLOCK_N): exact keys/values,
    in the [PER, BLOCK_N, D // PER] layout of _decode_tile. Every filled slot is visible: pooled
    tokens are stored tokens, all at or before the decode query (position L - 1). ROPE: pre-RoPE
    pool keys at their pool_pos (_decode_scores)."""
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
    """_attend_decode_kernel's body, its arguments grouped (triton_args.py)."""
    pid = tl.program_id(0)
    sp = tl.program_id(1)
    b = pid // HQ
    hq = pid % HQ
    bh64 = (b * H + hq // lay.QG).to(tl.int64)
    L = tl.load(lengths_ptr + b).to(tl.int32)
    nqk, nqv = _quantized_counts(L, lay.R, lay.G, lay.OTT)
    # The query [K_PER, D // K_PER] in the key tiles' layout, scale * log2(e) folded in.
    ik = tl.arange(0, lay.K_PER)
    jk = tl.arange(0, lay.D // lay.K_PER)
    ch_k = jk[None, :] * lay.K_PER + ik[:, None]
    q_row = q_ptr + b.to(tl.int64) * s_qb + hq.to(tl.int64) * s_qh
    q2 = tl.load(q_row + ch_k.to(tl.int64) * s_qd).to(tl.float32)
    q2 = q2 * qk_scale
    if rope.ROPE:
        # rot(q) = cat(-q[D/2:], q[:D/2]) (rope._rotate_half), read from the partner channels
        partner = (ch_k + lay.D // 2) % lay.D
        q2_rot = tl.load(q_row + partner.to(tl.int64) * s_qd).to(tl.float32) * qk_scale
        q2_rot = tl.where(ch_k < lay.D // 2, -q2_rot, q2_rot)
        freq = tl.load(rope.inv_freq + ch_k % (lay.D // 2))
    else:
        q2_rot = q2  # unused
        freq = q2  # unused
    query = (q2, q2_rot, freq)

    split_len = tl.cdiv(tl.cdiv(L, lay.NUM_SPLITS), lay.BLOCK_N) * lay.BLOCK_N
    lo = sp * split_len
    hi = tl.minimum(lo + split_len, L)
    # Split 0 also takes the pool's exact tokens; the reduce kernel merges them like any split.
    pool_end = tl.where(sp == 0, pool.P, 0)
    if HAS_COUNTS:
        real = tl.load(counts_ptr + b) > 0
        hi = tl.where(real, hi, lo)  # a padded row (counts 0) attends to nothing: 0
        pool_end = tl.where(real, pool_end, 0)
    mid = tl.maximum(tl.minimum((tl.minimum(nqk, nqv) // lay.BLOCK_N) * lay.BLOCK_N, hi), lo)
    if sparse.SPARSE:  # the outliers replace dequantized entries: every tile takes the MIXED path
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
    ch_v = jv[None, :] * lay.V_PER + iv[:, None]  # [V_PER, NBV]
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
    """Decode (q_len == 1): one program per (batch row, query head, split). GQA heads of one kv
    head read the same codes (L2 hits). Work items are per element, no tl.dot: a decode query is
    one row, and padding it to a 16-row tensor-core tile cost more in layout shuffles through
    shared memory than the products themselves (measured on H100, see benchmarks/results).
    The launched entry point: flat arguments (triton_args.py), grouped for _attend_decode."""
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
    """Attention of one query per row, query [B, Hq, 1, D] with D a power of two, over the cache,
    like attend_reference (module doc); anything else is a ValueError (attend_split takes it).
    The pool (t.pool) and KVQuant's nuq levels, pre-RoPE keys and sparse outlier store (t.extras)
    are read by the kernel. num_splits / block_n / num_warps /
    num_stages override the static choices (tests, tuning). pages: the layer is paged
    (paged_layout.Paging; its quantized buffers are page pools)."""
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
    block_n = min(block_n or default_block_n, G)  # within a key group
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
