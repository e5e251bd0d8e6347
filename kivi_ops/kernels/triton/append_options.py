"""Append-kernel jit helpers for the dense-and-sparse store and the sink/OTT pool, bit for bit the
reference's selection rules. OTT scores are fp32 sums in the kernel's order: a tie within an ulp could
resolve differently from torch, changing only which of two equally small tokens stays exact."""

from __future__ import annotations

import triton
import triton.language as tl

_PICKED = tl.constexpr(-2.0)
_BIG = tl.constexpr(1 << 30)


@triton.jit
def _pick_largest(mag, pos, AXIS: tl.constexpr):
    """One outlier pick along AXIS: (largest magnitude, its lowest position, mag with it marked)."""
    m = tl.max(mag, axis=AXIS)
    i = tl.min(tl.where(mag == tl.expand_dims(m, AXIS), pos, _BIG), axis=AXIS)
    return m, i, tl.where(pos == tl.expand_dims(i, AXIS), _PICKED, mag)


@triton.jit
def excluded(x, pos, thr, ithr):
    """Outliers of x given the last pick (thr, ithr): larger magnitudes, equal ones up to ithr."""
    a = tl.abs(x)
    return (a > thr) | ((a == thr) & (pos <= ithr))


@triton.jit
def load_rows(res, new, b, h, bh64, L, u, d, mask, D: tl.constexpr, R: tl.constexpr, RR: tl.constexpr):
    """fp32 exact rows of tokens u at channels d: ring slot u % RR below L, appended row u - L after."""
    from_res = u < L
    x_res = tl.load(res + (bh64 * RR + u % RR) * D + d, mask=from_res & mask, other=0.0)
    new_off = (b.to(tl.int64) * new.s_b + h.to(tl.int64) * new.s_h + (u - L).to(tl.int64) * new.s_n
               + d.to(tl.int64) * new.s_d)
    x_new = tl.load(new.ptr + new_off, mask=(~from_res) & mask, other=0.0)
    return tl.where(from_res, x_res, x_new).to(tl.float32)


@triton.jit
def is_pooled(u, entrants, SINK: tl.constexpr, N_OUT: tl.constexpr):
    pooled = u < SINK
    if N_OUT > 0:
        pooled = pooled | (tl.max((u[:, None] == entrants[None, :]).to(tl.int32), axis=1) > 0)
    return pooled


@triton.jit
def key_window_outliers(
    k_res, keys, sparse, entrants, b, h, bh64, L, window_start, jb, write, SINK: tl.constexpr, N_OUT: tl.constexpr,
    kl,
):
    """Per channel of bytes jb, the window's NK largest keys (pooled last), stored if `write`; returns
    the last pick for `excluded`."""
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
    """Per token u, the NV largest channels, stored; returns the last pick for `excluded`."""
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
    return tl.sum(tl.where(pos == i, x, 0), axis=0)


@triton.jit
def _row_l1(base, row, rmask, D: tl.constexpr, D_P: tl.constexpr, DC: tl.constexpr):
    acc = tl.zeros(row.shape, tl.float32)
    for d0 in tl.static_range(0, D_P, DC):
        d = d0 + tl.arange(0, DC)[None, :]
        acc += tl.sum(tl.abs(tl.load(base + row[:, None] * D + d, mask=rmask[:, None] & (d < D), other=0.0)
                             .to(tl.float32)), axis=1)
    return acc


@triton.jit
def ott_step(pool, k_res, keys, v_res, values, b, h, bh64, L, window_start, kl):
    """pool.ott_step for the window at window_start, in place; returns its new outliers [N_P] (-1: none)."""
    pool_k, pool_v, pool_pos, scratch = pool.pool_k, pool.pool_v, pool.pool_pos, pool.scratch
    off = tl.arange(0, kl.R_P)
    u = window_start + off
    score_w = tl.zeros((kl.R_P,), tl.float32)
    for d0 in tl.static_range(0, kl.D_P, kl.DC):
        dc = d0 + tl.arange(0, kl.DC)[None, :]
        x = load_rows(k_res, keys, b, h, bh64, L, u[:, None], dc, (off < kl.R)[:, None] & (dc < kl.D), kl.D, kl.R,
                      kl.RR)
        score_w += tl.sum(tl.abs(x), axis=1)
    score_w = tl.where((off < kl.R) & (u >= pool.SINK), score_w, float("inf"))
    slot = tl.arange(0, pool.N_P)
    in_pool = slot < pool.N_OUT
    old_pos = tl.load(pool_pos + bh64 * pool.P + pool.SINK + slot, mask=in_pool, other=-1).to(tl.int32)
    filled = old_pos >= 0
    score_p = tl.where(filled, _row_l1(pool_k, bh64 * pool.P + pool.SINK + slot, filled, kl.D, kl.D_P, kl.DC),
                       float("inf"))
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
    kept = tl.max((src_pool[None, :] == slot[:, None]).to(tl.int32), axis=1) > 0
    evicted = filled & ~kept
    spill = tl.arange(0, pool.SP_P)
    SP = pool.P - pool.SINK - pool.N_OUT
    spill_count = tl.sum((tl.load(pool_pos + bh64 * pool.P + pool.SINK + pool.N_OUT + spill, mask=spill < SP,
                                  other=-1) >= 0).to(tl.int32), axis=0)
    entrants = tl.full((pool.N_P,), -1, tl.int32)
    if tl.sum(evicted.to(tl.int32), axis=0) <= SP - spill_count:
        entrants = tl.where(src_win >= 0, window_start + src_win, -1)
        d = tl.arange(0, kl.D_P)
        dm = d < kl.D
        for i in range(pool.N_OUT):  # old outlier rows to scratch while their slots are rewritten
            row = (bh64 * pool.P + pool.SINK + i) * kl.D
            tmp = (bh64 * pool.N_OUT + i) * 2 * kl.D
            tl.store(scratch + tmp + d, tl.load(pool_k + row + d, mask=dm), mask=dm)
            tl.store(scratch + tmp + kl.D + d, tl.load(pool_v + row + d, mask=dm), mask=dm)
        tl.debug_barrier()
        dest = spill_count + tl.cumsum(evicted.to(tl.int32), axis=0) - 1
        for i in range(pool.N_OUT):
            if _at(evicted.to(tl.int32), slot, i) > 0:
                tmp = (bh64 * pool.N_OUT + i) * 2 * kl.D
                to = bh64 * pool.P + pool.SINK + pool.N_OUT + _at(dest, slot, i)
                tl.store(pool_k + to * kl.D + d, tl.load(scratch + tmp + d, mask=dm), mask=dm)
                tl.store(pool_v + to * kl.D + d, tl.load(scratch + tmp + kl.D + d, mask=dm), mask=dm)
                tl.store(pool_pos + to, _at(old_pos, slot, i).to(tl.int64))
        for r in range(pool.N_OUT):
            sp = _at(src_pool, slot, r)
            sw = _at(src_win, slot, r)
            to = bh64 * pool.P + pool.SINK + r
            k = tl.zeros((kl.D_P,), pool_k.dtype.element_ty)
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
