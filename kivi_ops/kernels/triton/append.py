"""Triton kernels of the cache append, append_triton: CUDA-graph safe (no host syncs; all data-dependent
logic predicated on lengths/counts in the kernels). One token: one launch (_append_decode_kernel). More:
key flush, value flush, residual writes, lengths, in that order (the flushes read ring slots the
residual writes overwrite). Unlike the reference, tokens past max_seq_len are dropped (a kernel cannot
raise). Each option is a constexpr flag; off, the kernels are the plain ones instruction for instruction."""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ...devices import resolve_device
from ...layout import LayerTensors, QuantParams
from ..reference.packing import codes_per_word
from ...options.schedule import OTT
from .append_options import (excluded, is_pooled, key_window_outliers, load_rows, ott_step,
                             value_token_outliers, write_sinks)
from .args import (CacheSide, KeyLayout, Levels, NewRows, OttPool, Sparse, ValueLayout, kernel_options,
                   option_args)
from .paging import Pages, cache_row, paging_args, static_dims
from .attend import check_cache, check_kernel_extras
from .quant import device_ctx, next_pow2, nuq_codes, pack_codes, quant_codes, scale_zero_stored, store_words


@triton.jit
def _stored_and_appended(lengths_ptr, counts_ptr, b, N, S, HAS_COUNTS: tl.constexpr):
    """(L stored, c appended now, clamped to [0, n] and to the free room S - L) of sequence b."""
    L = tl.load(lengths_ptr + b).to(tl.int32)
    if HAS_COUNTS:
        c = tl.minimum(tl.load(counts_ptr + b).to(tl.int32), N)
    else:
        c = tl.zeros_like(L) + N
    c = tl.maximum(tl.minimum(c, S - L), 0)
    return L, c


@triton.jit
def _flushed(L, c, UNIT: tl.constexpr, OTT: tl.constexpr, KEEP: tl.constexpr):
    """The key tokens [nqk, nqk_end) an append of c tokens to L quantizes (schedule.py)."""
    if OTT:
        nqk = (tl.maximum(L - KEEP, 0) // UNIT) * UNIT
        nqk_end = (tl.maximum(L + c - KEEP, 0) // UNIT) * UNIT
    else:
        nqk = (L // UNIT) * UNIT
        nqk_end = ((L + c) // UNIT) * UNIT
    return nqk, nqk_end


@triton.jit
def _quantize(x, scale, zero, levels, BITS: tl.constexpr, HAS_LEVELS: tl.constexpr):
    if HAS_LEVELS:
        return nuq_codes(x, scale, zero, levels, BITS)
    else:
        return quant_codes(x, scale, zero, (1 << BITS) - 1)


@triton.jit
def _minmax_kept(x, excl, AXIS: tl.constexpr):
    """min and max along AXIS without the excluded entries (0, 0 where all are, as the reference)."""
    mn = tl.min(tl.where(excl, float("inf"), x), axis=AXIS)
    mx = tl.max(tl.where(excl, float("-inf"), x), axis=AXIS)
    empty = mn > mx
    return tl.where(empty, 0.0, mn), tl.where(empty, 0.0, mx)


@triton.jit
def _flush_key_group(
    kc, keys, levels, entrants, b, h, bh64, L, start, jb, thr, ithr, S, NSG,
    SPARSE: tl.constexpr, SINK: tl.constexpr, N_OUT: tl.constexpr, kl, pg,
):
    """Quantize key group [start, start + G) per channel for the packed bytes jb, outliers and pooled
    tokens left out of the min/max."""
    u = start + tl.arange(0, kl.G)
    ii = tl.arange(0, kl.PER)
    ch = (jb[:, None] * kl.PER + ii[None, :])[None, :, :]
    cmask = ((jb < kl.NB)[:, None] & (ii < kl.PER)[None, :])[None, :, :]
    x = load_rows(kc.res, keys, b, h, bh64, L, u[:, None, None], ch, cmask, kl.D, kl.R, kl.RR)
    if SPARSE or SINK + N_OUT > 0:
        excl = tl.zeros(x.shape, tl.int1)
        if SPARSE:
            excl = excluded(x, (u % kl.R)[:, None, None], thr, ithr)
        if SINK + N_OUT > 0:
            excl = excl | is_pooled(u, entrants, SINK, N_OUT)[:, None, None]
        mn, mx = _minmax_kept(x, excl, 0)
    else:
        mn, mx = tl.min(x, axis=0), tl.max(x, axis=0)
    scale, zero = scale_zero_stored(mn, mx, (1 << kl.BITS) - 1, kc.scale.dtype.element_ty)
    srow = cache_row(bh64, start // kl.G, NSG, pg, pg.PAGE // kl.G) * kl.D
    tl.store(kc.scale + srow + ch, scale[None, :, :], mask=cmask)
    tl.store(kc.zero + srow + ch, zero[None, :, :], mask=cmask)
    q = _quantize(x, scale.to(tl.float32)[None, :, :], zero.to(tl.float32)[None, :, :], levels.k_levels, kl.BITS,
                  levels.HAS_LEVELS)
    packed = pack_codes(q, kl.BITS, kl.PER)
    store_words(kc.codes + cache_row(bh64, u[:, None], S, pg, pg.PAGE) * (kl.NB * (kl.PER * kl.BITS // 8)) + jb[None, :],
                kl.NB, kl.BITS, packed, (jb < kl.NB)[None, :])


@triton.jit
def _flush_key_window(kc, keys, v_res, values, levels, sparse, pool, b, h, bh64, L, window_start, S, NSG, kl, pg):
    """Quantize key window [window_start, + R) in the reference's order: OTT step, outliers, groups."""
    entrants = tl.full((pool.N_P,), -1, tl.int32)
    if pool.N_OUT > 0:
        entrants = ott_step(pool, kc.res, keys, v_res, values, b, h, bh64, L, window_start, kl)
    for jb0 in range(0, kl.NB, kl.BLOCK_B):
        jb = jb0 + tl.arange(0, kl.BLOCK_B)
        thr = tl.zeros((1, kl.BLOCK_B, kl.PER), tl.float32)
        ithr = tl.zeros((1, kl.BLOCK_B, kl.PER), tl.int32)
        if sparse.SPARSE:
            thr, ithr = key_window_outliers(kc.res, keys, sparse, entrants, b, h, bh64, L, window_start, jb, True,
                                            pool.SINK, pool.N_OUT, kl)
        for g in range(kl.R // kl.G):
            _flush_key_group(kc, keys, levels, entrants, b, h, bh64, L, window_start + g * kl.G, jb, thr, ithr, S,
                             NSG, sparse.SPARSE, pool.SINK, pool.N_OUT, kl, pg)


@triton.jit
def _append_key_flush(kc, keys, lengths_ptr, counts_ptr, HAS_COUNTS: tl.constexpr, levels, sparse, H, N, S, NSG, kl,
                      OTT: tl.constexpr, KEEP: tl.constexpr, pg):
    bh = tl.program_id(0)
    b = bh // H
    h = bh % H
    bh64 = bh.to(tl.int64)
    L, c = _stored_and_appended(lengths_ptr, counts_ptr, b, N, S, HAS_COUNTS)
    nqk, nqk_end = _flushed(L, c, kl.R, OTT, KEEP)
    start = nqk + tl.program_id(1) * kl.G
    if start < nqk_end:
        jb = tl.program_id(2) * kl.BLOCK_B + tl.arange(0, kl.BLOCK_B)
        thr = tl.zeros((1, kl.BLOCK_B, kl.PER), tl.float32)
        ithr = tl.zeros((1, kl.BLOCK_B, kl.PER), tl.int32)
        no_pool = tl.full((1,), -1, tl.int32)
        if sparse.SPARSE:  # every group selects the window's outliers; its first group stores them
            window_start = (start // kl.R) * kl.R
            thr, ithr = key_window_outliers(kc.res, keys, sparse, no_pool, b, h, bh64, L, window_start, jb,
                                            start == window_start, 0, 0, kl)
        _flush_key_group(kc, keys, levels, no_pool, b, h, bh64, L, start, jb, thr, ithr, S, NSG, sparse.SPARSE, 0, 0,
                         kl, pg)


@triton.jit
def _append_key_flush_kernel(
    k_codes, k_scale, k_zero, k_res, key_ptr, lengths_ptr, counts_ptr, k_levels, k_sparse, k_sparse_idx,
    s_kb, s_kh, s_kn, s_kd,
    H, N, S, NSG, NKR,
    HAS_COUNTS: tl.constexpr, HAS_LEVELS: tl.constexpr, SPARSE: tl.constexpr, NK: tl.constexpr, D: tl.constexpr,
    NB: tl.constexpr, BITS: tl.constexpr, PER: tl.constexpr,
    G: tl.constexpr, R: tl.constexpr, R_P: tl.constexpr, RR: tl.constexpr, BLOCK_B: tl.constexpr,
    OTT: tl.constexpr, KEEP: tl.constexpr,
    block_table, MAXP, NPAGES, PAGE: tl.constexpr, PAGED: tl.constexpr,
):
    """The key flush without a pool: one program per (b, h, key group, byte block)."""
    _append_key_flush(
        CacheSide(k_codes, k_scale, k_zero, k_res), NewRows(key_ptr, s_kb, s_kh, s_kn, s_kd), lengths_ptr, counts_ptr,
        HAS_COUNTS, Levels(k_levels, None, HAS_LEVELS), Sparse(k_sparse, k_sparse_idx, None, None, NKR, NK, 0, SPARSE),
        H, N, S, NSG, KeyLayout(D, None, None, NB, BITS, PER, BLOCK_B, G, R, R_P, RR), OTT, KEEP,
        Pages(block_table, MAXP, NPAGES, H, PAGE, PAGED),
    )


@triton.jit
def _flush_value_tokens(vc, values, levels, sparse, b, h, bh64, L, u, active, S, vl, pg):
    """Quantize value tokens u [BLOCK_T] (where active) per token, outliers out of the min/max."""
    from_res = (u < L)[:, None, None]
    jb = tl.arange(0, vl.GB_P)
    ii = tl.arange(0, vl.PER)
    m = active[:, None, None] & (jb < vl.GV // vl.PER)[None, :, None] & (ii < vl.PER)[None, None, :]
    res_row = (bh64 * vl.RR + (u % vl.RR)[:, None, None]) * vl.D
    new_row = (b.to(tl.int64) * values.s_b + h.to(tl.int64) * values.s_h
               + (u - L).to(tl.int64)[:, None, None] * values.s_n)
    thr = tl.zeros_like(u).to(tl.float32)
    ithr = tl.zeros_like(u)
    if sparse.SPARSE:
        thr, ithr = value_token_outliers(vc.res, values, sparse.v_sparse, sparse.v_sparse_idx, b, h, bh64, L, u,
                                         active, S, vl.D, vl.D_P, vl.R, vl.RR, sparse.NV)
    for g in range(vl.NG):
        ch = (g * vl.GV + jb[:, None] * vl.PER + ii[None, :])[None, :, :]
        x_res = tl.load(vc.res + res_row + ch, mask=m & from_res, other=0.0)
        x_new = tl.load(values.ptr + new_row + ch.to(tl.int64) * values.s_d, mask=m & (~from_res), other=0.0)
        x = tl.where(from_res, x_res, x_new).to(tl.float32)
        excl = ~m
        if sparse.SPARSE:
            excl = excl | excluded(x, ch, thr[:, None, None], ithr[:, None, None])
        mn = tl.min(tl.min(tl.where(excl, float("inf"), x), axis=2), axis=1)
        mx = tl.max(tl.max(tl.where(excl, float("-inf"), x), axis=2), axis=1)
        empty = mn > mx
        mn = tl.where(empty, 0.0, mn)
        mx = tl.where(empty, 0.0, mx)
        scale, zero = scale_zero_stored(mn, mx, (1 << vl.BITS) - 1, vc.scale.dtype.element_ty)
        srow = cache_row(bh64, u, S, pg, pg.PAGE) * vl.NG + g
        tl.store(vc.scale + srow, scale, mask=active)
        tl.store(vc.zero + srow, zero, mask=active)
        q = _quantize(x, scale.to(tl.float32)[:, None, None], zero.to(tl.float32)[:, None, None], levels.v_levels,
                      vl.BITS, levels.HAS_LEVELS)
        packed = pack_codes(q, vl.BITS, vl.PER)
        store_words(vc.codes + cache_row(bh64, u[:, None], S, pg, pg.PAGE) * (vl.NB * (vl.PER * vl.BITS // 8))
                    + g * (vl.GV // vl.PER) + jb[None, :], vl.NB, vl.BITS, packed,
                    active[:, None] & (jb < vl.GV // vl.PER)[None, :])


@triton.jit
def _append_value_flush_kernel(
    v_codes, v_scale, v_zero, v_res, value_ptr, lengths_ptr, counts_ptr, v_levels, v_sparse, v_sparse_idx,
    s_vb, s_vh, s_vn, s_vd,
    H, N, S,
    HAS_COUNTS: tl.constexpr, HAS_LEVELS: tl.constexpr, SPARSE: tl.constexpr, NV: tl.constexpr, D: tl.constexpr,
    D_P: tl.constexpr, NB: tl.constexpr, NG: tl.constexpr, BITS: tl.constexpr,
    PER: tl.constexpr, GV: tl.constexpr, GB_P: tl.constexpr, R: tl.constexpr, RR: tl.constexpr, BLOCK_T: tl.constexpr,
    OTT: tl.constexpr, G: tl.constexpr,
    block_table, MAXP, NPAGES, PAGE: tl.constexpr, PAGED: tl.constexpr,
):
    """The value flush: one program per (b, h, BLOCK_T tokens leaving the window)."""
    bh = tl.program_id(0)
    b = bh // H
    h = bh % H
    L, c = _stored_and_appended(lengths_ptr, counts_ptr, b, N, S, HAS_COUNTS)
    if OTT:
        q0, q1 = _flushed(L, c, G, True, R)
    else:
        q0 = tl.maximum(L - R, 0)
        q1 = tl.maximum(L + c - R, 0)
    first = q0 + tl.program_id(1) * BLOCK_T
    if first < q1:
        u = first + tl.arange(0, BLOCK_T)
        _flush_value_tokens(CacheSide(v_codes, v_scale, v_zero, v_res), NewRows(value_ptr, s_vb, s_vh, s_vn, s_vd),
                            Levels(None, v_levels, HAS_LEVELS),
                            Sparse(None, None, v_sparse, v_sparse_idx, 0, 0, NV, SPARSE), b, h, bh.to(tl.int64), L, u,
                            u < q1, S, ValueLayout(D, D_P, NB, NG, BITS, PER, GV, GB_P, R, RR),
                            Pages(block_table, MAXP, NPAGES, H, PAGE, PAGED))


@triton.jit
def _append_residual_kernel(
    k_res, v_res, key_ptr, value_ptr, lengths_ptr, counts_ptr, pool_k, pool_v, pool_pos,
    s_kb, s_kh, s_kn, s_kd, s_vb, s_vh, s_vn, s_vd,
    H, N, S, P,
    HAS_COUNTS: tl.constexpr, SINK: tl.constexpr, D: tl.constexpr, D_P: tl.constexpr, R: tl.constexpr,
    RR: tl.constexpr, BLOCK_T: tl.constexpr, OTT: tl.constexpr,
):
    """New tokens to their residual slots (sinks to the pool): one program per (b, h, BLOCK_T)."""
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
    slot = (bh.to(tl.int64) * RR + (u % RR)[:, None]) * D + d[None, :]
    i64 = i.to(tl.int64)[:, None]
    d64 = d.to(tl.int64)[None, :]
    if OTT:
        k_keep = (valid & (u >= end - RR))[:, None] & dmask
        v_keep = k_keep
    else:
        k_keep = (valid & (u >= (end // R) * R))[:, None] & dmask
        v_keep = (valid & (u >= end - R))[:, None] & dmask
    xk = tl.load(key_ptr + b.to(tl.int64) * s_kb + h.to(tl.int64) * s_kh + i64 * s_kn + d64 * s_kd, mask=k_keep)
    tl.store(k_res + slot, xk, mask=k_keep)
    xv = tl.load(value_ptr + b.to(tl.int64) * s_vb + h.to(tl.int64) * s_vh + i64 * s_vn + d64 * s_vd, mask=v_keep)
    tl.store(v_res + slot, xv, mask=v_keep)
    if SINK > 0:
        write_sinks(pool_k, pool_v, pool_pos, P, NewRows(key_ptr, s_kb, s_kh, s_kn, s_kd),
                    NewRows(value_ptr, s_vb, s_vh, s_vn, s_vd), b, h, bh.to(tl.int64), L, u, valid, D, D_P, SINK)


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


@triton.jit
def _append_decode(
    kc, vc, keys, values, lengths_ptr, counts_ptr, HAS_COUNTS: tl.constexpr, levels, sparse, pool, arrivals_ptr,
    H, S, NSG, kl, vl, OTT: tl.constexpr, KEEP: tl.constexpr, pg,
):
    bh = tl.program_id(0)
    b = bh // H
    h = bh % H
    bh64 = bh.to(tl.int64)
    L, c = _stored_and_appended(lengths_ptr, counts_ptr, b, 1, S, HAS_COUNTS)
    if c > 0:
        d = tl.arange(0, kl.D_P)
        dm = d < kl.D
        if pool.SINK > 0:
            if L < pool.SINK:
                write_sinks(pool.pool_k, pool.pool_v, pool.pool_pos, pool.P, keys, values, b, h, bh64, L,
                            L + tl.arange(0, 1), L + tl.arange(0, 1) >= 0, kl.D, kl.D_P, pool.SINK)
        if OTT:  # kl.R is the flush unit G here, KEEP the real R
            q0, q1 = _flushed(L, 1, kl.R, True, KEEP)
            if q1 > q0:
                _flush_key_window(kc, keys, vc.res, values, levels, sparse, pool, b, h, bh64, L, q0, S, NSG, kl, pg)
                u = q0 + tl.arange(0, kl.R_P)
                _flush_value_tokens(vc, values, levels, sparse, b, h, bh64, L, u, u < q1, S, vl, pg)
                tl.debug_barrier()  # the group's slots are read before the new token takes one
            v = tl.load(values.ptr + b.to(tl.int64) * values.s_b + h.to(tl.int64) * values.s_h + d * values.s_d,
                        mask=dm)
            tl.store(vc.res + (bh64 * kl.RR + L % kl.RR) * kl.D + d, v, mask=dm)
            k = tl.load(keys.ptr + b.to(tl.int64) * keys.s_b + h.to(tl.int64) * keys.s_h + d * keys.s_d, mask=dm)
            tl.store(kc.res + (bh64 * kl.RR + L % kl.RR) * kl.D + d, k, mask=dm)
        else:
            _append_decode_kivi(kc, vc, keys, values, levels, sparse, pool, b, h, bh64, L, d, dm, S, NSG, kl, vl, pg)
    arrived = tl.atomic_add(arrivals_ptr + b, 1, sem="acq_rel")
    if arrived == H - 1:
        tl.store(lengths_ptr + b, (L + c).to(lengths_ptr.dtype.element_ty))
        tl.store(arrivals_ptr + b, 0)


@triton.jit
def _append_decode_kivi(kc, vc, keys, values, levels, sparse, pool, b, h, bh64, L, d, dm, S, NSG, kl, vl, pg):
    if L >= kl.R:
        u = L - kl.R + tl.arange(0, 1)
        _flush_value_tokens(vc, values, levels, sparse, b, h, bh64, L, u, u >= 0, S, vl, pg)
        tl.debug_barrier()  # every thread has read the slot before it is overwritten
    v = tl.load(values.ptr + b.to(tl.int64) * values.s_b + h.to(tl.int64) * values.s_h + d * values.s_d, mask=dm)
    tl.store(vc.res + (bh64 * kl.RR + L % kl.RR) * kl.D + d, v, mask=dm)
    nqk = (L // kl.R) * kl.R
    if L + 1 - nqk == kl.R:
        if pool.N_OUT > 0:
            tl.debug_barrier()  # the OTT step reads the window's values, the new one included
        _flush_key_window(kc, keys, vc.res, values, levels, sparse, pool, b, h, bh64, L, nqk, S, NSG, kl, pg)
    else:
        k = tl.load(keys.ptr + b.to(tl.int64) * keys.s_b + h.to(tl.int64) * keys.s_h + d * keys.s_d, mask=dm)
        tl.store(kc.res + (bh64 * kl.RR + L - nqk) * kl.D + d, k, mask=dm)


@triton.jit
def _append_decode_kernel(
    k_codes, k_scale, k_zero, k_res, v_codes, v_scale, v_zero, v_res, key_ptr, value_ptr, lengths_ptr, counts_ptr,
    k_levels, v_levels, k_sparse, k_sparse_idx, v_sparse, v_sparse_idx, pool_k, pool_v, pool_pos, scratch,
    arrivals_ptr,
    s_kb, s_kh, s_kd, s_vb, s_vh, s_vd,
    H, S, NSG, NKR, P,
    HAS_COUNTS: tl.constexpr, HAS_LEVELS: tl.constexpr, SPARSE: tl.constexpr, NK: tl.constexpr, NV: tl.constexpr,
    SINK: tl.constexpr, N_OUT: tl.constexpr, N_P: tl.constexpr, SP_P: tl.constexpr,
    D: tl.constexpr, D_P: tl.constexpr, DC: tl.constexpr,
    K_NB: tl.constexpr, K_BITS: tl.constexpr, K_PER: tl.constexpr, BLOCK_B: tl.constexpr,
    V_NB: tl.constexpr, V_NG: tl.constexpr, V_BITS: tl.constexpr, V_PER: tl.constexpr, GV: tl.constexpr,
    GB_P: tl.constexpr, G: tl.constexpr, R: tl.constexpr, R_P: tl.constexpr, RR: tl.constexpr,
    OTT: tl.constexpr, KEEP: tl.constexpr,
    block_table, MAXP, NPAGES, PAGE: tl.constexpr, PAGED: tl.constexpr,
):
    """A decode step in one launch, one program per (b, h). The last of row b's H programs to arrive
    (acq_rel atomic on arrivals[b], reset to 0) updates lengths: the others have read it by then."""
    _append_decode(
        CacheSide(k_codes, k_scale, k_zero, k_res), CacheSide(v_codes, v_scale, v_zero, v_res),
        NewRows(key_ptr, s_kb, s_kh, 0, s_kd), NewRows(value_ptr, s_vb, s_vh, 0, s_vd), lengths_ptr, counts_ptr,
        HAS_COUNTS, Levels(k_levels, v_levels, HAS_LEVELS),
        Sparse(k_sparse, k_sparse_idx, v_sparse, v_sparse_idx, NKR, NK, NV, SPARSE),
        OttPool(pool_k, pool_v, pool_pos, scratch, P, SINK, N_OUT, N_P, SP_P), arrivals_ptr, H, S, NSG,
        KeyLayout(D, D_P, DC, K_NB, K_BITS, K_PER, BLOCK_B, G, R, R_P, RR),
        ValueLayout(D, D_P, V_NB, V_NG, V_BITS, V_PER, GV, GB_P, R, RR), OTT, KEEP,
        Pages(block_table, MAXP, NPAGES, H, PAGE, PAGED),
    )


@triton.jit
def _append_key_windows(kc, keys, v_res, values, lengths_ptr, counts_ptr, HAS_COUNTS: tl.constexpr, levels, sparse,
                        pool, H, N, S, NSG, kl, OTT: tl.constexpr, KEEP: tl.constexpr, pg):
    bh = tl.program_id(0)
    b = bh // H
    h = bh % H
    L, c = _stored_and_appended(lengths_ptr, counts_ptr, b, N, S, HAS_COUNTS)
    nqk, nqk_end = _flushed(L, c, kl.R, OTT, KEEP)
    for window_start in range(nqk, nqk_end, kl.R):
        _flush_key_window(kc, keys, v_res, values, levels, sparse, pool, b, h, bh.to(tl.int64), L, window_start, S,
                          NSG, kl, pg)


@triton.jit
def _append_key_windows_kernel(
    k_codes, k_scale, k_zero, k_res, key_ptr, v_res, value_ptr, lengths_ptr, counts_ptr, k_levels, k_sparse,
    k_sparse_idx, pool_k, pool_v, pool_pos, scratch,
    s_kb, s_kh, s_kn, s_kd, s_vb, s_vh, s_vn, s_vd,
    H, N, S, NSG, NKR, P,
    HAS_COUNTS: tl.constexpr, HAS_LEVELS: tl.constexpr, SPARSE: tl.constexpr, NK: tl.constexpr,
    SINK: tl.constexpr, N_OUT: tl.constexpr, N_P: tl.constexpr, SP_P: tl.constexpr,
    D: tl.constexpr, D_P: tl.constexpr, DC: tl.constexpr, NB: tl.constexpr, BITS: tl.constexpr, PER: tl.constexpr,
    BLOCK_B: tl.constexpr, G: tl.constexpr, R: tl.constexpr, R_P: tl.constexpr, RR: tl.constexpr,
    OTT: tl.constexpr, KEEP: tl.constexpr,
    block_table, MAXP, NPAGES, PAGE: tl.constexpr, PAGED: tl.constexpr,
):
    """The key flush with a pool, one program per (b, h): windows in order, as each OTT step needs."""
    _append_key_windows(
        CacheSide(k_codes, k_scale, k_zero, k_res), NewRows(key_ptr, s_kb, s_kh, s_kn, s_kd), v_res,
        NewRows(value_ptr, s_vb, s_vh, s_vn, s_vd), lengths_ptr, counts_ptr, HAS_COUNTS,
        Levels(k_levels, None, HAS_LEVELS), Sparse(k_sparse, k_sparse_idx, None, None, NKR, NK, 0, SPARSE),
        OttPool(pool_k, pool_v, pool_pos, scratch, P, SINK, N_OUT, N_P, SP_P), H, N, S, NSG,
        KeyLayout(D, D_P, DC, NB, BITS, PER, BLOCK_B, G, R, R_P, RR), OTT, KEEP,
        Pages(block_table, MAXP, NPAGES, H, PAGE, PAGED),
    )


_ARRIVALS: dict[torch.device, torch.Tensor] = {}


def reserve_arrival_counters(device, batch: int) -> torch.Tensor:
    """int32 zeros [>= batch] for _append_decode_kernel, one buffer per device. Allocate before
    compiling: one allocated in a CUDA-graph pool outlives the graph and cudagraph trees refuse it."""
    device = resolve_device(device)
    counters = _ARRIVALS.get(device)
    if counters is None or counters.numel() < batch:
        if torch.compiler.is_compiling():
            raise RuntimeError(f"the decode append's arrival counters for {device} (batch {batch}) must be "
                               "allocated before compiling: build the cache (KIVILayer reserves them) or call "
                               "kivi_ops.kernels.triton.append.reserve_arrival_counters first")
        counters = _ARRIVALS[device] = torch.zeros(max(batch, 64), dtype=torch.int32, device=device)
        torch._dynamo.mark_static_address(counters)
    return counters


def append_triton(t: LayerTensors, key: torch.Tensor, value: torch.Tensor, counts: Optional[torch.Tensor],
                  p: QuantParams, *, pages=None) -> None:
    """Append key/value [B, H, n, D] in place like append_reference; the sparse store and pool
    buffers must be contiguous."""
    if pages is None:
        B, H, S, D, R, RR, G, gv = check_cache(t, p)
    else:
        B, H, S, D, R, RR, G, gv = static_dims(t, p, pages)
    options = option_args(t, p, check_kernel_extras(t, p, sparse_ok=True), writes=True)
    options.update(paging_args(pages, t, G))
    # Under OTT the key kernels' window R becomes the flush unit G, KEEP the real R.
    ott = p.flush_policy == OTT
    options.update(OTT=ott, KEEP=R)
    unit = G if ott else R
    sparse = options["SPARSE"]
    k_codes, k_scale, k_zero, k_res, v_codes, v_scale, v_zero, v_res, lengths = t.kivi
    k_bits, v_bits = p.k_bits, p.v_bits
    n = key.shape[2]
    if tuple(key.shape) != (B, H, n, D) or tuple(value.shape) != (B, H, n, D):
        raise ValueError(f"key/value must have shape {(B, H, 'n', D)}, got {tuple(key.shape)}, {tuple(value.shape)}")
    if B == 0 or H == 0 or n == 0:
        return
    if key.dtype != k_res.dtype:
        key = key.to(k_res.dtype)
    if value.dtype != v_res.dtype:
        value = value.to(v_res.dtype)
    has_counts = counts is not None
    cnt = counts if has_counts else lengths  # never read
    kper, vper = codes_per_word(k_bits), codes_per_word(v_bits)
    nbk, nbv = D // kper, D // vper
    nsg = k_scale.shape[2] if pages is None else S // G
    key_groups = ((unit - 1 + n) // unit) * unit // G
    # Tiles of at most 2048 elements: [G, bytes * codes], with the sparse store [R, bytes * codes].
    r_p = next_pow2(unit)
    block_b = max(1, min(next_pow2(nbk), 2048 // ((r_p if sparse else G) * kper)))
    gb_p = next_pow2(gv // vper)
    block_tv = max(1, min(32, next_pow2(n), 2048 // (gb_p * vper)))
    d_p = next_pow2(D)
    block_tr = max(1, min(32, next_pow2(n), 4096 // d_p))
    dc = min(d_p, max(1, 2048 // r_p))
    wrap = torch.library.wrap_triton
    k_strides, v_strides = key.stride(), value.stride()
    if n == 1:
        with device_ctx(k_codes):
            wrap(_append_decode_kernel)[(B * H,)](
                k_codes, k_scale, k_zero, k_res, v_codes, v_scale, v_zero, v_res, key, value, lengths, cnt,
                arrivals_ptr=reserve_arrival_counters(lengths.device, B),
                s_kb=k_strides[0], s_kh=k_strides[1], s_kd=k_strides[3],
                s_vb=v_strides[0], s_vh=v_strides[1], s_vd=v_strides[3], H=H, S=S, NSG=nsg, HAS_COUNTS=has_counts,
                D=D, D_P=d_p, DC=dc, K_NB=nbk, K_BITS=k_bits, K_PER=kper, BLOCK_B=block_b,
                V_NB=nbv, V_NG=D // gv, V_BITS=v_bits, V_PER=vper, GV=gv, GB_P=gb_p, G=G, R=unit, R_P=r_p, RR=RR,
                **kernel_options(_append_decode_kernel, options), num_warps=4,
            )
        return
    with device_ctx(k_codes):
        if options["HAS_POOL"]:
            wrap(_append_key_windows_kernel)[(B * H,)](
                k_codes, k_scale, k_zero, k_res, key, v_res, value, lengths, cnt,
                s_kb=k_strides[0], s_kh=k_strides[1], s_kn=k_strides[2], s_kd=k_strides[3],
                s_vb=v_strides[0], s_vh=v_strides[1], s_vn=v_strides[2], s_vd=v_strides[3],
                H=H, N=n, S=S, NSG=nsg, HAS_COUNTS=has_counts, D=D, D_P=d_p, DC=dc, NB=nbk, BITS=k_bits, PER=kper,
                BLOCK_B=block_b, G=G, R=unit, R_P=r_p, RR=RR,
                **kernel_options(_append_key_windows_kernel, options), num_warps=4,
            )
        else:
            wrap(_append_key_flush_kernel)[(B * H, key_groups, triton.cdiv(nbk, block_b))](
                k_codes, k_scale, k_zero, k_res, key, lengths, cnt,
                s_kb=k_strides[0], s_kh=k_strides[1], s_kn=k_strides[2], s_kd=k_strides[3],
                H=H, N=n, S=S, NSG=nsg, HAS_COUNTS=has_counts, D=D, NB=nbk, BITS=k_bits, PER=kper, G=G, R=unit,
                R_P=r_p, RR=RR, BLOCK_B=block_b, **kernel_options(_append_key_flush_kernel, options), num_warps=4,
            )
        value_tokens = key_groups * G if ott else n
        wrap(_append_value_flush_kernel)[(B * H, triton.cdiv(value_tokens, block_tv))](
            v_codes, v_scale, v_zero, v_res, value, lengths, cnt,
            s_vb=v_strides[0], s_vh=v_strides[1], s_vn=v_strides[2], s_vd=v_strides[3], H=H, N=n, S=S,
            HAS_COUNTS=has_counts, D=D, D_P=d_p, NB=nbv, NG=D // gv, BITS=v_bits, PER=vper, GV=gv, GB_P=gb_p, R=R,
            RR=RR, BLOCK_T=block_tv, G=G, **kernel_options(_append_value_flush_kernel, options), num_warps=4,
        )
        wrap(_append_residual_kernel)[(B * H, triton.cdiv(n, block_tr))](
            k_res, v_res, key, value, lengths, cnt,
            s_kb=k_strides[0], s_kh=k_strides[1], s_kn=k_strides[2], s_kd=k_strides[3],
            s_vb=v_strides[0], s_vh=v_strides[1], s_vn=v_strides[2], s_vd=v_strides[3], H=H, N=n, S=S,
            HAS_COUNTS=has_counts, D=D, D_P=d_p, R=R, RR=RR, BLOCK_T=block_tr,
            **kernel_options(_append_residual_kernel, options), num_warps=4,
        )
        wrap(_append_lengths_kernel)[(1,)](
            lengths, cnt, B, n, S, HAS_COUNTS=has_counts, BLOCK=min(1024, next_pow2(B)), num_warps=1,
        )
