"""Jit helpers of the append kernels (triton_append.py) for the options that change what a flush
writes: the dense-and-sparse outlier store (extras.py) and the sink/OTT token pool (pool.py).

Both follow the decomposed and reference appends bit for bit:
  - outlier selection: dense_sparse.select_outliers' rule, one pick at a time (largest
    magnitude first, the lowest position of equal ones; pooled tokens, marked -1, are picked only
    after every other entry; picked entries are marked -2, padding -3 and never picked). The last
    pick (magnitude thr at position ithr) describes the whole set: an entry is an outlier iff its
    magnitude exceeds thr, or equals it at a position up to ithr (`excluded`).
  - OTT step: pool.ott_step's rule, one pick at a time (smallest L1 key norm first; of equal
    ones the pool before the window, then the lowest slot or position). Scores are fp32 sums over
    head_dim in the kernel's order (torch sums in another): a tie within an ulp could resolve
    differently, which random keys never produce and which would only change which of two
    equally small tokens stays exact.
Pooled tokens (sinks, new outliers) stay out of their key group's min/max, like outliers.
"""

from __future__ import annotations

import triton
import triton.language as tl

_PICKED = tl.constexpr(-2.0)
_BIG = tl.constexpr(1 << 30)


@triton.jit
def _pick_largest(mag, pos, AXIS: tl.constexpr):
    """One pick of the outlier selection along AXIS: the largest magnitude m, its position i (the
    lowest of equal ones), and mag with it marked picked."""
    m = tl.max(mag, axis=AXIS)
    i = tl.min(tl.where(mag == tl.expand_dims(m, AXIS), pos, _BIG), axis=AXIS)
    return m, i, tl.where(pos == tl.expand_dims(i, AXIS), _PICKED, mag)


@triton.jit
def excluded(x, pos, thr, ithr):
    """The outliers among x (fp32) given the selection's last pick (magnitude thr at position ithr,
    both broadcast to x): larger magnitudes, and equal ones at positions up to ithr."""
    a = tl.abs(x)
    return (a > thr) | ((a == thr) & (pos <= ithr))


@triton.jit
def load_rows(res, new, b, h, bh64, L, u, d, mask, D: tl.constexpr, R: tl.constexpr, RR: tl.constexpr):
    """Exact rows of tokens u (a residual ring buffer's slot u % RR below L: RR rows, R or R + G - 1
    under OTT's flush policy, capped at S > u; the appended tensor's row u - L from L on; new:
    triton_args.NewRows) at channels d, fp32, 0 where mask is off; u and d broadcast to the tile."""
    from_res = u < L
    x_res = tl.load(res + (bh64 * RR + u % RR) * D + d, mask=from_res & mask, other=0.0)
    new_off = (b.to(tl.int64) * new.s_b + h.to(tl.int64) * new.s_h + (u - L).to(tl.int64) * new.s_n
               + d.to(tl.int64) * new.s_d)
    x_new = tl.load(new.ptr + new_off, mask=(~from_res) & mask, other=0.0)
    return tl.where(from_res, x_res, x_new).to(tl.float32)


@triton.jit
def is_pooled(u, entrants, SINK: tl.constexpr, N_OUT: tl.constexpr):
    """[T] bool: token u is a sink or one of the window's new outliers, entrants [N_P] (-1: none)."""
    pooled = u < SINK
    if N_OUT > 0:
        pooled = pooled | (tl.max((u[:, None] == entrants[None, :]).to(tl.int32), axis=1) > 0)
    return pooled


@triton.jit
def key_window_outliers(
    k_res, keys, sparse, entrants, b, h, bh64, L, window_start, jb, write, SINK: tl.constexpr, N_OUT: tl.constexpr,
    kl,
):
    """Dense-and-sparse keys: per channel of the bytes jb, the NK largest magnitudes among the R
    tokens of the window starting at window_start (pooled ones last); written (if `write`) to
    rows window * NK + r of the sparse store with their token offsets. Returns the last pick
    (magnitude, offset) [1, BLOCK_B, PER] for `excluded`. keys: the appended keys (NewRows);
    sparse: triton_args.Sparse; kl: the key flush's KeyLayout."""
    ii = tl.arange(0, kl.PER)
    ch = (jb[:, None] * kl.PER + ii[None, :])[None, :, :]
    cmask = ((jb < kl.NB)[:, None] & (ii < kl.PER)[None, :])[None, :, :]
    off1 = tl.arange(0, kl.R_P)
    u1 = window_start + off1
    in_window = (off1 < kl.R)[:, None, None]
    off = off1[:, None, None]
    x = load_rows(k_res, keys, b, h, bh64, L, u1[:, None, None], ch, cmask & in_window, kl.D, kl.R, kl.RR)
    mag = tl.where(in_window, tl.abs(x), -3.0)
    if SINK + N_OUT > 0:
        mag = tl.where(is_pooled(u1, entrants, SINK, N_OUT)[:, None, None] & in_window, -1.0, mag)
    m = tl.zeros((1, jb.shape[0], kl.PER), tl.float32)
    i = tl.zeros((1, jb.shape[0], kl.PER), tl.int32)
    for r in tl.static_range(sparse.NK):
        m, i, mag = _pick_largest(mag, off, 0)
        m = m[None, :, :]
        i = i[None, :, :]
        val = tl.max(tl.where(off == i, x, float("-inf")), axis=0)[None, :, :]
        row = (bh64 * sparse.NKR + (window_start // kl.R) * sparse.NK + r) * kl.D
        tl.store(sparse.k_sparse + row + ch, val.to(sparse.k_sparse.dtype.element_ty), mask=cmask & write)
        tl.store(sparse.k_sparse_idx + row + ch, i.to(tl.int16), mask=cmask & write)
    return m, i


@triton.jit
def value_token_outliers(
    v_res, values, v_sparse, v_sparse_idx, b, h, bh64, L, u, active, S,
    D: tl.constexpr, D_P: tl.constexpr, R: tl.constexpr, RR: tl.constexpr, NV: tl.constexpr,
):
    """Dense-and-sparse values: per token u [BLOCK_T] (where active), the NV channels of largest
    magnitude, written to the token's row of the sparse store with their channels. Returns the
    last pick (magnitude, channel) [BLOCK_T] for `excluded`. values: the appended values (NewRows)."""
    d = tl.arange(0, D_P)[None, :]
    x = load_rows(v_res, values, b, h, bh64, L, u[:, None], d, active[:, None] & (d < D), D, R, RR)
    mag = tl.where(d < D, tl.abs(x), -3.0)
    m = tl.zeros_like(u).to(tl.float32)
    i = tl.zeros_like(u)
    row = (bh64 * S + u) * NV
    for r in tl.static_range(NV):
        m, i, mag = _pick_largest(mag, d, 1)
        val = tl.max(tl.where(d == i[:, None], x, float("-inf")), axis=1)
        tl.store(v_sparse + row + r, val.to(v_sparse.dtype.element_ty), mask=active)
        tl.store(v_sparse_idx + row + r, i.to(tl.int16), mask=active)
    return m, i


@triton.jit
def write_sinks(pool_k, pool_v, pool_pos, P, keys, values, b, h, bh64, L, u, valid,
                D: tl.constexpr, D_P: tl.constexpr, SINK: tl.constexpr):
    """New tokens u [T] (where valid) at positions below SINK take pool slot u (exact). keys,
    values: the appended rows (triton_args.NewRows)."""
    d = tl.arange(0, D_P)[None, :]
    take = valid & (u < SINK)
    m = take[:, None] & (d < D)
    i = (u - L).to(tl.int64)[:, None]
    k = tl.load(keys.ptr + b.to(tl.int64) * keys.s_b + h.to(tl.int64) * keys.s_h + i * keys.s_n
                + d.to(tl.int64) * keys.s_d, mask=m)
    v = tl.load(values.ptr + b.to(tl.int64) * values.s_b + h.to(tl.int64) * values.s_h + i * values.s_n
                + d.to(tl.int64) * values.s_d, mask=m)
    slot = bh64 * P + u
    tl.store(pool_k + slot[:, None] * D + d, k, mask=m)
    tl.store(pool_v + slot[:, None] * D + d, v, mask=m)
    tl.store(pool_pos + slot, u.to(tl.int64), mask=take)


@triton.jit
def _at(x, pos, i):
    """x[i] of a small vector x with positions pos, as a scalar."""
    return tl.sum(tl.where(pos == i, x, 0), axis=0)


@triton.jit
def _row_l1(base, row, rmask, D: tl.constexpr, D_P: tl.constexpr, DC: tl.constexpr):
    """L1 norms [T] of rows `row` [T] of a [., D] buffer (fp32, chunks of DC channels)."""
    acc = tl.zeros(row.shape, tl.float32)
    for d0 in tl.static_range(0, D_P, DC):
        d = d0 + tl.arange(0, DC)[None, :]
        acc += tl.sum(tl.abs(tl.load(base + row[:, None] * D + d, mask=rmask[:, None] & (d < D), other=0.0)
                             .to(tl.float32)), axis=1)
    return acc


@triton.jit
def ott_step(pool, k_res, keys, v_res, values, b, h, bh64, L, window_start, kl):
    """One OTT step (pool.ott_step) for the window of R tokens at window_start of one (sequence,
    kv head): updates the outlier pool (slots [SINK, SINK + N_OUT)) and the spill pool (the rest)
    in place and returns the window's new outliers [N_P] (positions, -1: none). pool.scratch holds
    a copy of the old outlier pool while it is rewritten ([N_OUT, 2, D] per (b, h)). pool:
    triton_args.OttPool; keys, values: the appended rows (NewRows); kl: the key flush's KeyLayout."""
    pool_k, pool_v, pool_pos, scratch = pool.pool_k, pool.pool_v, pool.pool_pos, pool.scratch
    off = tl.arange(0, kl.R_P)
    u = window_start + off
    # Window scores: L1 norms of the exact keys, tokens that are not sinks.
    score_w = tl.zeros((kl.R_P,), tl.float32)
    for d0 in tl.static_range(0, kl.D_P, kl.DC):
        dc = d0 + tl.arange(0, kl.DC)[None, :]
        x = load_rows(k_res, keys, b, h, bh64, L, u[:, None], dc, (off < kl.R)[:, None] & (dc < kl.D), kl.D, kl.R,
                      kl.RR)
        score_w += tl.sum(tl.abs(x), axis=1)
    score_w = tl.where((off < kl.R) & (u >= pool.SINK), score_w, float("inf"))
    # Pool scores.
    slot = tl.arange(0, pool.N_P)
    in_pool = slot < pool.N_OUT
    old_pos = tl.load(pool_pos + bh64 * pool.P + pool.SINK + slot, mask=in_pool, other=-1).to(tl.int32)
    filled = old_pos >= 0
    score_p = tl.where(filled, _row_l1(pool_k, bh64 * pool.P + pool.SINK + slot, filled, kl.D, kl.D_P, kl.DC),
                       float("inf"))
    # N_OUT picks of the smallest score: the pool before the window on ties, then the lowest index.
    src_pool = tl.full((pool.N_P,), -1, tl.int32)
    src_win = tl.full((pool.N_P,), -1, tl.int32)
    for r in range(pool.N_OUT):
        mp = tl.min(score_p, axis=0)
        mw = tl.min(score_w, axis=0)
        # As int32 flags: Triton's interpreter cannot & a float comparison's scalar with a vector.
        from_pool = ((mp <= mw) & (mp < float("inf"))).to(tl.int32) > 0
        from_window = ((mw < mp) & (mw < float("inf"))).to(tl.int32) > 0
        ip = tl.min(tl.where(score_p == mp, slot, _BIG), axis=0)
        iw = tl.min(tl.where(score_w == mw, off, _BIG), axis=0)
        src_pool = tl.where((slot == r) & from_pool, ip, src_pool)
        src_win = tl.where((slot == r) & from_window, iw, src_win)
        score_p = tl.where(from_pool & (slot == ip), float("inf"), score_p)
        score_w = tl.where(from_window & (off == iw), float("inf"), score_w)
    kept = tl.max((src_pool[None, :] == slot[:, None]).to(tl.int32), axis=1) > 0  # [N_P]: old slot kept
    evicted = filled & ~kept
    spill = tl.arange(0, pool.SP_P)
    SP = pool.P - pool.SINK - pool.N_OUT
    spill_count = tl.sum((tl.load(pool_pos + bh64 * pool.P + pool.SINK + pool.N_OUT + spill, mask=spill < SP,
                                  other=-1) >= 0).to(tl.int32), axis=0)
    entrants = tl.full((pool.N_P,), -1, tl.int32)
    if tl.sum(evicted.to(tl.int32), axis=0) <= SP - spill_count:  # else the step changes nothing
        entrants = tl.where(src_win >= 0, window_start + src_win, -1)
        d = tl.arange(0, kl.D_P)
        dm = d < kl.D
        for i in range(pool.N_OUT):  # keep the old outlier rows while their slots are rewritten
            row = (bh64 * pool.P + pool.SINK + i) * kl.D
            tmp = (bh64 * pool.N_OUT + i) * 2 * kl.D
            tl.store(scratch + tmp + d, tl.load(pool_k + row + d, mask=dm), mask=dm)
            tl.store(scratch + tmp + kl.D + d, tl.load(pool_v + row + d, mask=dm), mask=dm)
        tl.debug_barrier()
        dest = spill_count + tl.cumsum(evicted.to(tl.int32), axis=0) - 1
        for i in range(pool.N_OUT):  # evicted tokens join the spill pool, in their old order
            if _at(evicted.to(tl.int32), slot, i) > 0:
                tmp = (bh64 * pool.N_OUT + i) * 2 * kl.D
                to = bh64 * pool.P + pool.SINK + pool.N_OUT + _at(dest, slot, i)
                tl.store(pool_k + to * kl.D + d, tl.load(scratch + tmp + d, mask=dm), mask=dm)
                tl.store(pool_v + to * kl.D + d, tl.load(scratch + tmp + kl.D + d, mask=dm), mask=dm)
                tl.store(pool_pos + to, _at(old_pos, slot, i).to(tl.int64))
        for r in range(pool.N_OUT):  # the new outlier pool, in pick order
            sp = _at(src_pool, slot, r)
            sw = _at(src_win, slot, r)
            to = bh64 * pool.P + pool.SINK + r
            k = tl.zeros((kl.D_P,), pool_k.dtype.element_ty)  # an empty slot: zeros, position -1
            v = tl.zeros((kl.D_P,), pool_v.dtype.element_ty)
            pos = sp * 0 - 1
            if sp >= 0:
                tmp = (bh64 * pool.N_OUT + sp) * 2 * kl.D
                k = tl.load(scratch + tmp + d, mask=dm, other=0.0)
                v = tl.load(scratch + tmp + kl.D + d, mask=dm, other=0.0)
                pos = _at(old_pos, slot, sp)
            if sw >= 0:
                k = load_rows(k_res, keys, b, h, bh64, L, window_start + sw, d, dm, kl.D, kl.R, kl.RR)
                k = k.to(pool_k.dtype.element_ty)
                v = load_rows(v_res, values, b, h, bh64, L, window_start + sw, d, dm, kl.D, kl.R, kl.RR)
                v = v.to(pool_v.dtype.element_ty)
                pos = window_start + sw
            tl.store(pool_k + to * kl.D + d, k, mask=dm)
            tl.store(pool_v + to * kl.D + d, v, mask=dm)
            tl.store(pool_pos + to, pos.to(tl.int64))
        tl.debug_barrier()
    return entrants
