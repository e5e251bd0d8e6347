"""Triton kernels of the KIVI cache append (streaming quantization): append_triton.

Layout and streaming policy: kivi_ops/layout.py; kernels/reference.py (append_reference) is the
specification these kernels are tested against. The launcher is CUDA-graph safe: no host syncs,
every grid is derived from static shapes, and all data-dependent logic (how many tokens flush,
which slots are live) is predicated on `lengths`/`counts` inside the kernels.

append_triton, for one token per sequence (a decode step): one launch, _append_decode_kernel,
which does all of the below per (b, h) and updates lengths in the row's last program. For more
tokens, four launches on the current stream (the order removes the read-before-write hazards of
the residual ring buffers):
  1. _append_key_flush_kernel   grid (B*H, max key groups flushed per call, D byte blocks):
     group i of the window [nqk, nqk_end) is read from k_res (tokens < L) or from `key`, quantized
     per channel and written to k_codes/k_scale/k_zero. With a sink/OTT pool instead
     _append_key_windows_kernel, grid (B*H,): the windows in order, since each OTT step starts
     from the pool the previous one left (it reads the windows' values from v_res / `value`).
  2. _append_value_flush_kernel grid (B*H, cdiv(n, BLOCK_T)): values leaving the R-token window,
     tokens [max(L-R,0), max(L+c-R,0)), read from v_res (tokens < L) or `value`, quantized per token.
  3. _append_residual_kernel    grid (B*H, cdiv(n, BLOCK_T)): new tokens that stay full precision
     go to slot t % R of k_res / v_res (keys: t >= nqk_end; values: t >= L+c-R); tokens at
     positions below sink_tokens also go to their pool slots.
  4. _append_lengths_kernel     grid (1,): lengths += c.
  Launches 1-2 read residual slots that launch 3 overwrites; launch 4 changes what 1-3 read.
  Difference from the CPU reference: tokens past max_seq_len S are dropped (c = min(counts, n,
  S - L)) instead of raising, since a kernel cannot raise without a host sync; lengths then
  stops at S. Counts are also clamped to [0, n].
Every option is covered, each a constexpr flag (off = the plain kernels, instruction for
instruction):
  - KVQuant's nuq levels (HAS_LEVELS): the flush kernels quantize to the nearest level (binary
    search over the level midpoints, nuq_codes).
  - the dense-and-sparse store (SPARSE): a key window's per-channel outliers and a value token's
    per-token outliers are selected, stored and left out of the min/max
    (triton_append_options.py).
  - the sink/OTT pool (SINK, N_OUT): sinks are copied to their slots; each key window runs the
    OTT step (pool.ott_step) before it is quantized without its pooled tokens.
  - pre-RoPE keys are stored as given (rope_inv_freq plays no part in appends).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ..extras import key_outliers_per_window
from ..layout import LayerTensors, QuantParams
from ..packing import codes_per_byte
from .triton_append_options import (excluded, is_pooled, key_window_outliers, load_rows, ott_step,
                                    value_token_outliers, write_sinks)
from .triton_attend import check_cache, check_kernel_extras
from .triton_quant import device_ctx, next_pow2, nuq_codes, pack_codes, quant_codes, scale_zero_stored


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
def _minmax_kept(x, excl, AXIS: tl.constexpr):
    """min and max of x along AXIS without the excluded entries (0, 0 where all are excluded:
    packing.quantize_pack_reference's rule)."""
    mn = tl.min(tl.where(excl, float("inf"), x), axis=AXIS)
    mx = tl.max(tl.where(excl, float("-inf"), x), axis=AXIS)
    empty = mn > mx
    return tl.where(empty, 0.0, mn), tl.where(empty, 0.0, mx)


@triton.jit
def _flush_key_group(
    k_codes, k_scale, k_zero, k_res, key_ptr, k_levels, entrants, b, h, bh64, L, start, jb, thr, ithr,
    s_kb, s_kh, s_kn, s_kd, S, NSG,
    HAS_LEVELS: tl.constexpr, SPARSE: tl.constexpr, SINK: tl.constexpr, N_OUT: tl.constexpr, D: tl.constexpr,
    NB: tl.constexpr, BITS: tl.constexpr, PER: tl.constexpr, G: tl.constexpr, R: tl.constexpr, RR: tl.constexpr,
):
    """Quantize key tokens [start, start + G) (one group, from k_res below L, else from key)
    per channel, for the packed bytes jb [BLOCK_B], and write codes, scale and zero. Out of the
    min/max: with SPARSE the window's outliers (thr, ithr from key_window_outliers), with a pool
    the sinks and the window's new outliers (entrants)."""
    u = start + tl.arange(0, G)
    ii = tl.arange(0, PER)
    ch = (jb[:, None] * PER + ii[None, :])[None, :, :]  # [1, BLOCK_B, PER]
    cmask = ((jb < NB)[:, None] & (ii < PER)[None, :])[None, :, :]
    x = load_rows(k_res, key_ptr, b, h, bh64, L, u[:, None, None], ch, cmask, s_kb, s_kh, s_kn, s_kd, D, R, RR)
    if SPARSE or SINK + N_OUT > 0:
        excl = tl.zeros(x.shape, tl.int1)
        if SPARSE:
            excl = excluded(x, (u % R)[:, None, None], thr, ithr)
        if SINK + N_OUT > 0:
            excl = excl | is_pooled(u, entrants, SINK, N_OUT)[:, None, None]
        mn, mx = _minmax_kept(x, excl, 0)
    else:
        mn, mx = tl.min(x, axis=0), tl.max(x, axis=0)
    scale, zero = scale_zero_stored(mn, mx, (1 << BITS) - 1, k_scale.dtype.element_ty)
    srow = (bh64 * NSG + start // G) * D
    tl.store(k_scale + srow + ch, scale[None, :, :], mask=cmask)
    tl.store(k_zero + srow + ch, zero[None, :, :], mask=cmask)
    q = _quantize(x, scale.to(tl.float32)[None, :, :], zero.to(tl.float32)[None, :, :], k_levels, BITS, HAS_LEVELS)
    packed = pack_codes(q, BITS, PER)  # [G, BLOCK_B]
    tl.store(k_codes + (bh64 * S + u[:, None]) * NB + jb[None, :], packed, mask=(jb < NB)[None, :])


@triton.jit
def _flush_key_window(
    k_codes, k_scale, k_zero, k_res, key_ptr, v_res, value_ptr, k_levels, k_sparse, k_sparse_idx,
    pool_k, pool_v, pool_pos, scratch, b, h, bh64, L, window_start, P,
    s_kb, s_kh, s_kn, s_kd, s_vb, s_vh, s_vn, s_vd, S, NSG, KS_ROWS,
    HAS_LEVELS: tl.constexpr, SPARSE: tl.constexpr, NK: tl.constexpr, SINK: tl.constexpr, N_OUT: tl.constexpr,
    N_P: tl.constexpr, SP_P: tl.constexpr, D: tl.constexpr, D_P: tl.constexpr, DC: tl.constexpr, NB: tl.constexpr,
    BITS: tl.constexpr, PER: tl.constexpr, BLOCK_B: tl.constexpr, G: tl.constexpr, R: tl.constexpr,
    R_P: tl.constexpr, RR: tl.constexpr,
):
    """Quantize the whole key window [window_start, window_start + R) of one (sequence, kv head),
    every option included, in the reference's order: the OTT step (N_OUT > 0), the sparse store's
    outliers (SPARSE, pooled tokens last), then the R / G groups."""
    entrants = tl.full((N_P,), -1, tl.int32)
    if N_OUT > 0:
        entrants = ott_step(pool_k, pool_v, pool_pos, scratch, k_res, key_ptr, v_res, value_ptr, b, h, bh64, L,
                            window_start, P, s_kb, s_kh, s_kn, s_kd, s_vb, s_vh, s_vn, s_vd,
                            D, D_P, DC, R, R_P, RR, SINK, N_OUT, N_P, SP_P)
    for jb0 in range(0, NB, BLOCK_B):
        jb = jb0 + tl.arange(0, BLOCK_B)
        thr = tl.zeros((1, BLOCK_B, PER), tl.float32)
        ithr = tl.zeros((1, BLOCK_B, PER), tl.int32)
        if SPARSE:
            thr, ithr = key_window_outliers(k_res, key_ptr, k_sparse, k_sparse_idx, entrants, b, h, bh64, L,
                                            window_start, jb, True, s_kb, s_kh, s_kn, s_kd, KS_ROWS, D, NB, PER,
                                            R, R_P, RR, NK, SINK, N_OUT)
        for g in range(R // G):
            _flush_key_group(k_codes, k_scale, k_zero, k_res, key_ptr, k_levels, entrants, b, h, bh64, L,
                             window_start + g * G, jb, thr, ithr, s_kb, s_kh, s_kn, s_kd, S, NSG, HAS_LEVELS, SPARSE,
                             SINK, N_OUT, D, NB, BITS, PER, G, R, RR)


@triton.jit
def _append_key_flush_kernel(
    k_codes, k_scale, k_zero, k_res, key_ptr, lengths_ptr, counts_ptr, k_levels, k_sparse, k_sparse_idx,
    s_kb, s_kh, s_kn, s_kd,
    H, N, S, NSG, KS_ROWS,
    HAS_COUNTS: tl.constexpr, HAS_LEVELS: tl.constexpr, SPARSE: tl.constexpr, NK: tl.constexpr, D: tl.constexpr,
    NB: tl.constexpr, BITS: tl.constexpr, PER: tl.constexpr,
    G: tl.constexpr, R: tl.constexpr, R_P: tl.constexpr, RR: tl.constexpr, BLOCK_B: tl.constexpr,
):
    bh = tl.program_id(0)
    b = bh // H
    h = bh % H
    bh64 = bh.to(tl.int64)
    L, c = _stored_and_appended(lengths_ptr, counts_ptr, b, N, S, HAS_COUNTS)
    nqk = (L // R) * R
    nqk_end = ((L + c) // R) * R
    start = nqk + tl.program_id(1) * G
    if start < nqk_end:  # tokens of this group, all < nqk_end <= L + c
        jb = tl.program_id(2) * BLOCK_B + tl.arange(0, BLOCK_B)
        thr = tl.zeros((1, BLOCK_B, PER), tl.float32)
        ithr = tl.zeros((1, BLOCK_B, PER), tl.int32)
        no_pool = tl.full((1,), -1, tl.int32)
        if SPARSE:  # every group of a window selects its outliers; the window's first group stores them
            window_start = (start // R) * R
            thr, ithr = key_window_outliers(k_res, key_ptr, k_sparse, k_sparse_idx, no_pool, b, h, bh64, L,
                                            window_start, jb, start == window_start, s_kb, s_kh, s_kn, s_kd, KS_ROWS,
                                            D, NB, PER, R, R_P, RR, NK, 0, 0)
        _flush_key_group(k_codes, k_scale, k_zero, k_res, key_ptr, k_levels, no_pool, b, h, bh64, L, start, jb, thr,
                         ithr, s_kb, s_kh, s_kn, s_kd, S, NSG, HAS_LEVELS, SPARSE, 0, 0, D, NB, BITS, PER, G, R, RR)


@triton.jit
def _flush_value_tokens(
    v_codes, v_scale, v_zero, v_res, value_ptr, v_levels, v_sparse, v_sparse_idx, b, h, bh64, L, u, active,
    s_vb, s_vh, s_vn, s_vd, S,
    HAS_LEVELS: tl.constexpr, SPARSE: tl.constexpr, NV: tl.constexpr, D: tl.constexpr, D_P: tl.constexpr,
    NB: tl.constexpr, NG: tl.constexpr, BITS: tl.constexpr,
    PER: tl.constexpr, GV: tl.constexpr, GB_P: tl.constexpr, R: tl.constexpr, RR: tl.constexpr,
):
    """Quantize value tokens u [BLOCK_T] (where active; from v_res below L, else from value) per
    token, and write codes, scales and zeros to their rows u. SPARSE: each token's NV outliers go
    to the sparse store and stay out of their group's min/max."""
    from_res = (u < L)[:, None, None]
    jb = tl.arange(0, GB_P)
    ii = tl.arange(0, PER)
    m = active[:, None, None] & (jb < GV // PER)[None, :, None] & (ii < PER)[None, None, :]
    res_row = (bh64 * RR + (u % R)[:, None, None]) * D
    new_row = (b.to(tl.int64) * s_vb + h.to(tl.int64) * s_vh + (u - L).to(tl.int64)[:, None, None] * s_vn)
    thr = tl.zeros_like(u).to(tl.float32)
    ithr = tl.zeros_like(u)
    if SPARSE:
        thr, ithr = value_token_outliers(v_res, value_ptr, v_sparse, v_sparse_idx, b, h, bh64, L, u, active,
                                         s_vb, s_vh, s_vn, s_vd, S, D, D_P, R, RR, NV)
    for g in range(NG):
        ch = (g * GV + jb[:, None] * PER + ii[None, :])[None, :, :]
        x_res = tl.load(v_res + res_row + ch, mask=m & from_res, other=0.0)
        x_new = tl.load(value_ptr + new_row + ch.to(tl.int64) * s_vd, mask=m & (~from_res), other=0.0)
        x = tl.where(from_res, x_res, x_new).to(tl.float32)
        excl = ~m
        if SPARSE:
            excl = excl | excluded(x, ch, thr[:, None, None], ithr[:, None, None])
        mn = tl.min(tl.min(tl.where(excl, float("inf"), x), axis=2), axis=1)
        mx = tl.max(tl.max(tl.where(excl, float("-inf"), x), axis=2), axis=1)
        empty = mn > mx  # inactive tokens, or every entry an outlier: 0, 0 as in the reference
        mn = tl.where(empty, 0.0, mn)
        mx = tl.where(empty, 0.0, mx)
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
def _append_value_flush_kernel(
    v_codes, v_scale, v_zero, v_res, value_ptr, lengths_ptr, counts_ptr, v_levels, v_sparse, v_sparse_idx,
    s_vb, s_vh, s_vn, s_vd,
    H, N, S,
    HAS_COUNTS: tl.constexpr, HAS_LEVELS: tl.constexpr, SPARSE: tl.constexpr, NV: tl.constexpr, D: tl.constexpr,
    D_P: tl.constexpr, NB: tl.constexpr, NG: tl.constexpr, BITS: tl.constexpr,
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
        u = first + tl.arange(0, BLOCK_T)
        _flush_value_tokens(v_codes, v_scale, v_zero, v_res, value_ptr, v_levels, v_sparse, v_sparse_idx, b, h,
                            bh.to(tl.int64), L, u, u < q1, s_vb, s_vh, s_vn, s_vd, S, HAS_LEVELS, SPARSE, NV, D, D_P,
                            NB, NG, BITS, PER, GV, GB_P, R, RR)


@triton.jit
def _append_residual_kernel(
    k_res, v_res, key_ptr, value_ptr, lengths_ptr, counts_ptr, pool_k, pool_v, pool_pos,
    s_kb, s_kh, s_kn, s_kd, s_vb, s_vh, s_vn, s_vd,
    H, N, S, P,
    HAS_COUNTS: tl.constexpr, SINK: tl.constexpr, D: tl.constexpr, D_P: tl.constexpr, R: tl.constexpr,
    RR: tl.constexpr, BLOCK_T: tl.constexpr,
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
    if SINK > 0:  # new tokens at positions below SINK also take their pool slots
        write_sinks(pool_k, pool_v, pool_pos, key_ptr, value_ptr, b, h, bh.to(tl.int64), L, u, valid, P,
                    s_kb, s_kh, s_kn, s_kd, s_vb, s_vh, s_vn, s_vd, D, D_P, SINK)


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
def _append_decode_kernel(
    k_codes, k_scale, k_zero, k_res, v_codes, v_scale, v_zero, v_res, key_ptr, value_ptr, lengths_ptr, counts_ptr,
    k_levels, v_levels, k_sparse, k_sparse_idx, v_sparse, v_sparse_idx, pool_k, pool_v, pool_pos, scratch,
    arrivals_ptr,
    s_kb, s_kh, s_kd, s_vb, s_vh, s_vd,
    H, S, NSG, KS_ROWS, P,
    HAS_COUNTS: tl.constexpr, HAS_LEVELS: tl.constexpr, SPARSE: tl.constexpr, NK: tl.constexpr, NV: tl.constexpr,
    SINK: tl.constexpr, N_OUT: tl.constexpr, N_P: tl.constexpr, SP_P: tl.constexpr,
    D: tl.constexpr, D_P: tl.constexpr, DC: tl.constexpr,
    K_NB: tl.constexpr, K_BITS: tl.constexpr, K_PER: tl.constexpr, BLOCK_B: tl.constexpr,
    V_NB: tl.constexpr, V_NG: tl.constexpr, V_BITS: tl.constexpr, V_PER: tl.constexpr, GV: tl.constexpr,
    GB_P: tl.constexpr, G: tl.constexpr, R: tl.constexpr, R_P: tl.constexpr, RR: tl.constexpr,
):
    """One token per sequence (a decode step), everything in one launch, one program per (b, h):
    the value leaving the window is quantized (from slot L % R, which the new value then takes),
    the new key goes to its residual slot or, when it completes the window [nqk, L], the window is
    quantized per channel (once every R steps), and lengths[b] += c. Options: a token at a
    position below SINK also takes its pool slot; the window flush runs the OTT step and keeps the
    sparse store's outliers (_flush_key_window); the value flush keeps the value outliers. The
    last of row b's H programs to arrive (an acq_rel atomic on arrivals[b], which it resets to 0)
    updates lengths: every other program of the row has read it by then."""
    bh = tl.program_id(0)
    b = bh // H
    h = bh % H
    bh64 = bh.to(tl.int64)
    L, c = _stored_and_appended(lengths_ptr, counts_ptr, b, 1, S, HAS_COUNTS)
    if c > 0:
        d = tl.arange(0, D_P)
        dm = d < D
        if SINK > 0:
            if L < SINK:
                write_sinks(pool_k, pool_v, pool_pos, key_ptr, value_ptr, b, h, bh64, L, L + tl.arange(0, 1),
                            L + tl.arange(0, 1) >= 0, P, s_kb, s_kh, 0, s_kd, s_vb, s_vh, 0, s_vd, D, D_P, SINK)
        if L >= R:  # token L - R leaves the value window
            u = L - R + tl.arange(0, 1)
            _flush_value_tokens(v_codes, v_scale, v_zero, v_res, value_ptr, v_levels, v_sparse, v_sparse_idx, b, h,
                                bh64, L, u, u >= 0, s_vb, s_vh, 0, s_vd, S, HAS_LEVELS, SPARSE, NV, D, D_P, V_NB,
                                V_NG, V_BITS, V_PER, GV, GB_P, R, RR)
            tl.debug_barrier()  # every thread has read the slot before it is overwritten
        v = tl.load(value_ptr + b.to(tl.int64) * s_vb + h.to(tl.int64) * s_vh + d * s_vd, mask=dm)
        tl.store(v_res + (bh64 * RR + L % R) * D + d, v, mask=dm)
        nqk = (L // R) * R
        if L + 1 - nqk == R:
            if N_OUT > 0:
                tl.debug_barrier()  # the OTT step reads the window's values, the new one included
            _flush_key_window(k_codes, k_scale, k_zero, k_res, key_ptr, v_res, value_ptr, k_levels, k_sparse,
                              k_sparse_idx, pool_k, pool_v, pool_pos, scratch, b, h, bh64, L, nqk, P,
                              s_kb, s_kh, 0, s_kd, s_vb, s_vh, 0, s_vd, S, NSG, KS_ROWS, HAS_LEVELS, SPARSE, NK, SINK,
                              N_OUT, N_P, SP_P, D, D_P, DC, K_NB, K_BITS, K_PER, BLOCK_B, G, R, R_P, RR)
        else:
            k = tl.load(key_ptr + b.to(tl.int64) * s_kb + h.to(tl.int64) * s_kh + d * s_kd, mask=dm)
            tl.store(k_res + (bh64 * RR + L - nqk) * D + d, k, mask=dm)
    arrived = tl.atomic_add(arrivals_ptr + b, 1, sem="acq_rel")
    if arrived == H - 1:
        tl.store(lengths_ptr + b, (L + c).to(lengths_ptr.dtype.element_ty))
        tl.store(arrivals_ptr + b, 0)


@triton.jit
def _append_key_windows_kernel(
    k_codes, k_scale, k_zero, k_res, key_ptr, v_res, value_ptr, lengths_ptr, counts_ptr, k_levels, k_sparse,
    k_sparse_idx, pool_k, pool_v, pool_pos, scratch,
    s_kb, s_kh, s_kn, s_kd, s_vb, s_vh, s_vn, s_vd,
    H, N, S, NSG, KS_ROWS, P,
    HAS_COUNTS: tl.constexpr, HAS_LEVELS: tl.constexpr, SPARSE: tl.constexpr, NK: tl.constexpr,
    SINK: tl.constexpr, N_OUT: tl.constexpr, N_P: tl.constexpr, SP_P: tl.constexpr,
    D: tl.constexpr, D_P: tl.constexpr, DC: tl.constexpr, NB: tl.constexpr, BITS: tl.constexpr, PER: tl.constexpr,
    BLOCK_B: tl.constexpr, G: tl.constexpr, R: tl.constexpr, R_P: tl.constexpr, RR: tl.constexpr,
):
    """The key flush of a layer with a sink/OTT pool, one program per (b, h): the windows
    [nqk, nqk_end) in order (each OTT step sees the pool the previous one left)."""
    bh = tl.program_id(0)
    b = bh // H
    h = bh % H
    L, c = _stored_and_appended(lengths_ptr, counts_ptr, b, N, S, HAS_COUNTS)
    nqk = (L // R) * R
    nqk_end = ((L + c) // R) * R
    for window_start in range(nqk, nqk_end, R):
        _flush_key_window(k_codes, k_scale, k_zero, k_res, key_ptr, v_res, value_ptr, k_levels, k_sparse,
                          k_sparse_idx, pool_k, pool_v, pool_pos, scratch, b, h, bh.to(tl.int64), L, window_start, P,
                          s_kb, s_kh, s_kn, s_kd, s_vb, s_vh, s_vn, s_vd, S, NSG, KS_ROWS, HAS_LEVELS, SPARSE, NK,
                          SINK, N_OUT, N_P, SP_P, D, D_P, DC, NB, BITS, PER, BLOCK_B, G, R, R_P, RR)


_ARRIVALS: dict[torch.device, torch.Tensor] = {}


def _arrival_counters(device: torch.device, batch: int) -> torch.Tensor:
    """int32 zeros [>= batch] on `device` for _append_decode_kernel, which leaves them zero: one
    buffer per device, reused by every layer and call (launches on a stream run in order)."""
    counters = _ARRIVALS.get(device)
    if counters is None or counters.numel() < batch:
        counters = _ARRIVALS[device] = torch.zeros(max(batch, 64), dtype=torch.int32, device=device)
    return counters


def _pool_launch_args(t: LayerTensors, p: QuantParams, B: int, H: int, D: int):
    """(pool_k, pool_v, pool_pos, scratch, P, constexprs) of a layer's sink/OTT pool for the
    kernels; dummy pointers without one (SINK = N_OUT = 0 compiles no pool code)."""
    pool = t.pool
    if pool is None:
        return t.k_scale, t.k_scale, t.lengths, t.k_scale, 0, dict(SINK=0, N_OUT=0, N_P=1, SP_P=1)
    for name, x in zip(("pool_k", "pool_v", "pool_pos"), pool):
        if not x.is_contiguous():
            raise ValueError(f"{name} must be contiguous: the append writes it in place")
    pool_k, pool_v, pool_pos = pool
    P, sink, n_out = pool_pos.shape[-1], p.sink_tokens, p.outlier_tokens
    if (tuple(pool_k.shape) != (B, H, P, D) or tuple(pool_v.shape) != (B, H, P, D) or pool_pos.dtype != torch.int64
            or pool_k.dtype != t.k_res.dtype or pool_v.dtype != t.v_res.dtype or sink + n_out > P):
        raise ValueError(f"the pool must be pool_k/pool_v [B, H, P, D] = [{B}, {H}, P, {D}] in the cache dtype and "
                         f"pool_pos int64 [B, H, P] with P >= sink_tokens + outlier_tokens = {sink + n_out}, got "
                         f"{list(pool_k.shape)}, {list(pool_v.shape)}, {pool_pos.dtype} {list(pool_pos.shape)}")
    # The OTT step keeps the old outlier rows here while it rewrites their slots.
    scratch = pool_k.new_empty((B * H, n_out, 2, D)) if n_out else pool_k
    return pool_k, pool_v, pool_pos, scratch, P, dict(SINK=sink, N_OUT=n_out, N_P=next_pow2(max(n_out, 1)),
                                                       SP_P=next_pow2(max(P - sink - n_out, 1)))


def append_triton(t: LayerTensors, key: torch.Tensor, value: torch.Tensor, counts: Optional[torch.Tensor],
                  p: QuantParams) -> None:
    """Append key/value [B, H, n, D] in place, like append_reference (module doc), every option
    included: nuq levels (t.k_levels / t.v_levels) quantize; the dense-and-sparse store
    (t.k_sparse ..) and the sink/OTT pool (t.pool_k ..) are written in place, so their buffers must
    be contiguous; t.rope_inv_freq plays no part in appends."""
    B, H, S, D, R, RR, G, gv = check_cache(t, p)
    extras = check_kernel_extras(t, p, sparse_ok=True)
    sparse = extras.sparse
    if sparse:
        for name in ("k_sparse", "k_sparse_idx", "v_sparse", "v_sparse_idx"):
            if not getattr(t, name).is_contiguous():
                raise ValueError(f"{name} must be contiguous: the append writes it in place")
        k_sparse, k_sparse_idx, v_sparse, v_sparse_idx = t.k_sparse, t.k_sparse_idx, t.v_sparse, t.v_sparse_idx
        nk, nv = key_outliers_per_window(k_sparse, S, R), v_sparse.shape[-1]
    else:  # dummy pointers (never read: SPARSE=False compiles no outlier code)
        k_sparse = k_sparse_idx = v_sparse = v_sparse_idx = t.k_scale
        nk = nv = 0
    ks_rows = k_sparse.shape[2]
    pool_k, pool_v, pool_pos, scratch, P, pool_flags = _pool_launch_args(t, p, B, H, D)
    has_pool = t.pool is not None
    k_codes, k_scale, k_zero, k_res, v_codes, v_scale, v_zero, v_res, lengths = t.kivi
    k_bits, v_bits = p.k_bits, p.v_bits
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
    # Byte blocks of a key flush: a [G, bytes * codes] tile per group; with the sparse store also a
    # whole window's [R, bytes * codes] (the outlier selection), kept at 2048 elements too.
    r_p = next_pow2(R)
    block_b = max(1, min(next_pow2(nbk), 2048 // ((r_p if sparse else G) * kper)))
    gb_p = next_pow2(gv // vper)
    block_tv = max(1, min(32, next_pow2(n), 2048 // (gb_p * vper)))
    d_p = next_pow2(D)
    block_tr = max(1, min(32, next_pow2(n), 4096 // d_p))
    dc = min(d_p, max(1, 2048 // r_p))  # channels per chunk of the OTT scores ([R, DC] tiles)
    wrap = torch.library.wrap_triton
    k_strides, v_strides = key.stride(), value.stride()
    if n == 1:  # a decode step: one launch
        with device_ctx(k_codes):
            wrap(_append_decode_kernel)[(B * H,)](
                k_codes, k_scale, k_zero, k_res, v_codes, v_scale, v_zero, v_res, key, value, lengths, cnt,
                k_levels, v_levels, k_sparse, k_sparse_idx, v_sparse, v_sparse_idx, pool_k, pool_v, pool_pos, scratch,
                _arrival_counters(lengths.device, B),
                k_strides[0], k_strides[1], k_strides[3], v_strides[0], v_strides[1], v_strides[3],
                H, S, nsg, ks_rows, P,
                HAS_COUNTS=has_counts, HAS_LEVELS=has_levels, SPARSE=sparse, NK=nk, NV=nv, **pool_flags,
                D=D, D_P=d_p, DC=dc, K_NB=nbk, K_BITS=k_bits, K_PER=kper, BLOCK_B=block_b,
                V_NB=nbv, V_NG=D // gv, V_BITS=v_bits, V_PER=vper, GV=gv, GB_P=gb_p, G=G, R=R, R_P=r_p, RR=RR,
                num_warps=4,
            )
        return
    with device_ctx(k_codes):
        if has_pool:  # window by window: each OTT step sees the pool the previous one left
            wrap(_append_key_windows_kernel)[(B * H,)](
                k_codes, k_scale, k_zero, k_res, key, v_res, value, lengths, cnt, k_levels, k_sparse, k_sparse_idx,
                pool_k, pool_v, pool_pos, scratch, *k_strides, *v_strides,
                H, n, S, nsg, ks_rows, P,
                HAS_COUNTS=has_counts, HAS_LEVELS=has_levels, SPARSE=sparse, NK=nk, **pool_flags, D=D, D_P=d_p,
                DC=dc, NB=nbk, BITS=k_bits, PER=kper, BLOCK_B=block_b, G=G, R=R, R_P=r_p, RR=RR, num_warps=4,
            )
        else:
            wrap(_append_key_flush_kernel)[(B * H, key_groups, triton.cdiv(nbk, block_b))](
                k_codes, k_scale, k_zero, k_res, key, lengths, cnt, k_levels, k_sparse, k_sparse_idx, *k_strides,
                H, n, S, nsg, ks_rows,
                HAS_COUNTS=has_counts, HAS_LEVELS=has_levels, SPARSE=sparse, NK=nk, D=D, NB=nbk, BITS=k_bits,
                PER=kper, G=G, R=R, R_P=r_p, RR=RR, BLOCK_B=block_b, num_warps=4,
            )
        wrap(_append_value_flush_kernel)[(B * H, triton.cdiv(n, block_tv))](
            v_codes, v_scale, v_zero, v_res, value, lengths, cnt, v_levels, v_sparse, v_sparse_idx, *v_strides,
            H, n, S,
            HAS_COUNTS=has_counts, HAS_LEVELS=has_levels, SPARSE=sparse, NV=nv, D=D, D_P=d_p, NB=nbv, NG=D // gv,
            BITS=v_bits, PER=vper, GV=gv, GB_P=gb_p, R=R, RR=RR, BLOCK_T=block_tv, num_warps=4,
        )
        wrap(_append_residual_kernel)[(B * H, triton.cdiv(n, block_tr))](
            k_res, v_res, key, value, lengths, cnt, pool_k, pool_v, pool_pos, *k_strides, *v_strides,
            H, n, S, P,
            HAS_COUNTS=has_counts, SINK=pool_flags["SINK"], D=D, D_P=d_p, R=R, RR=RR, BLOCK_T=block_tr, num_warps=4,
        )
        wrap(_append_lengths_kernel)[(1,)](
            lengths, cnt, B, n, S, HAS_COUNTS=has_counts, BLOCK=min(1024, next_pow2(B)), num_warps=1,
        )
