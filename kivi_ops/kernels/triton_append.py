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
KVQuant's nuq levels (t.k_levels / t.v_levels; HAS_LEVELS, a constexpr flag, off = the plain
kernels, instruction for instruction): the flush kernels quantize to the nearest level (binary
search over the level midpoints, nuq_codes). Pre-RoPE keys are stored as given (rope_inv_freq plays
no part in appends). No kernel covers the sink/OTT token pool or the dense-and-sparse outlier
store: the dispatcher runs the decomposed append for them, and append_triton refuses them.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ..layout import LayerTensors, QuantParams
from ..packing import codes_per_byte
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
def _flush_key_group(
    k_codes, k_scale, k_zero, k_res, key_ptr, k_levels, b, h, bh64, L, start, jb,
    s_kb, s_kh, s_kn, s_kd, S, NSG,
    HAS_LEVELS: tl.constexpr, D: tl.constexpr, NB: tl.constexpr, BITS: tl.constexpr, PER: tl.constexpr,
    G: tl.constexpr, R: tl.constexpr, RR: tl.constexpr,
):
    """Quantize key tokens [start, start + G) (one group, from k_res below L, else from key)
    per channel, for the packed bytes jb [BLOCK_B], and write codes, scale and zero."""
    u = start + tl.arange(0, G)
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
    if start < nqk_end:  # tokens of this group, all < nqk_end <= L + c
        jb = tl.program_id(2) * BLOCK_B + tl.arange(0, BLOCK_B)
        _flush_key_group(k_codes, k_scale, k_zero, k_res, key_ptr, k_levels, b, h, bh.to(tl.int64), L, start, jb,
                         s_kb, s_kh, s_kn, s_kd, S, NSG, HAS_LEVELS, D, NB, BITS, PER, G, R, RR)


@triton.jit
def _flush_value_tokens(
    v_codes, v_scale, v_zero, v_res, value_ptr, v_levels, b, h, bh64, L, u, active,
    s_vb, s_vh, s_vn, s_vd, S,
    HAS_LEVELS: tl.constexpr, D: tl.constexpr, NB: tl.constexpr, NG: tl.constexpr, BITS: tl.constexpr,
    PER: tl.constexpr, GV: tl.constexpr, GB_P: tl.constexpr, R: tl.constexpr, RR: tl.constexpr,
):
    """Quantize value tokens u [BLOCK_T] (where active; from v_res below L, else from value) per
    token, and write codes, scales and zeros to their rows u."""
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
        u = first + tl.arange(0, BLOCK_T)
        _flush_value_tokens(v_codes, v_scale, v_zero, v_res, value_ptr, v_levels, b, h, bh.to(tl.int64), L, u,
                            u < q1, s_vb, s_vh, s_vn, s_vd, S, HAS_LEVELS, D, NB, NG, BITS, PER, GV, GB_P, R, RR)


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


@triton.jit
def _append_decode_kernel(
    k_codes, k_scale, k_zero, k_res, v_codes, v_scale, v_zero, v_res, key_ptr, value_ptr, lengths_ptr, counts_ptr,
    k_levels, v_levels, arrivals_ptr,
    s_kb, s_kh, s_kd, s_vb, s_vh, s_vd,
    H, S, NSG,
    HAS_COUNTS: tl.constexpr, HAS_LEVELS: tl.constexpr, D: tl.constexpr, D_P: tl.constexpr,
    K_NB: tl.constexpr, K_BITS: tl.constexpr, K_PER: tl.constexpr, BLOCK_B: tl.constexpr,
    V_NB: tl.constexpr, V_NG: tl.constexpr, V_BITS: tl.constexpr, V_PER: tl.constexpr, GV: tl.constexpr,
    GB_P: tl.constexpr, G: tl.constexpr, R: tl.constexpr, RR: tl.constexpr,
):
    """One token per sequence (a decode step), everything in one launch, one program per (b, h):
    the value leaving the window is quantized (from slot L % R, which the new value then takes),
    the new key goes to its residual slot or, when it completes the window [nqk, L], the window is
    quantized per channel (once every R steps), and lengths[b] += c. The last of row b's H
    programs to arrive (an acq_rel atomic on arrivals[b], which it resets to 0) updates lengths:
    every other program of the row has read it by then."""
    bh = tl.program_id(0)
    b = bh // H
    h = bh % H
    bh64 = bh.to(tl.int64)
    L, c = _stored_and_appended(lengths_ptr, counts_ptr, b, 1, S, HAS_COUNTS)
    if c > 0:
        d = tl.arange(0, D_P)
        dm = d < D
        if L >= R:  # token L - R leaves the value window
            u = L - R + tl.arange(0, 1)
            _flush_value_tokens(v_codes, v_scale, v_zero, v_res, value_ptr, v_levels, b, h, bh64, L, u, u >= 0,
                                s_vb, s_vh, 0, s_vd, S, HAS_LEVELS, D, V_NB, V_NG, V_BITS, V_PER, GV, GB_P, R, RR)
            tl.debug_barrier()  # every thread has read the slot before it is overwritten
        v = tl.load(value_ptr + b.to(tl.int64) * s_vb + h.to(tl.int64) * s_vh + d * s_vd, mask=dm)
        tl.store(v_res + (bh64 * RR + L % R) * D + d, v, mask=dm)
        nqk = (L // R) * R
        if L + 1 - nqk == R:
            for g in range(R // G):
                for jb0 in range(0, K_NB, BLOCK_B):
                    _flush_key_group(k_codes, k_scale, k_zero, k_res, key_ptr, k_levels, b, h, bh64, L, nqk + g * G,
                                     jb0 + tl.arange(0, BLOCK_B), s_kb, s_kh, 0, s_kd, S, NSG, HAS_LEVELS, D, K_NB,
                                     K_BITS, K_PER, G, R, RR)
        else:
            k = tl.load(key_ptr + b.to(tl.int64) * s_kb + h.to(tl.int64) * s_kh + d * s_kd, mask=dm)
            tl.store(k_res + (bh64 * RR + L - nqk) * D + d, k, mask=dm)
    arrived = tl.atomic_add(arrivals_ptr + b, 1, sem="acq_rel")
    if arrived == H - 1:
        tl.store(lengths_ptr + b, (L + c).to(lengths_ptr.dtype.element_ty))
        tl.store(arrivals_ptr + b, 0)


_ARRIVALS: dict[torch.device, torch.Tensor] = {}


def _arrival_counters(device: torch.device, batch: int) -> torch.Tensor:
    """int32 zeros [>= batch] on `device` for _append_decode_kernel, which leaves them zero: one
    buffer per device, reused by every layer and call (launches on a stream run in order)."""
    counters = _ARRIVALS.get(device)
    if counters is None or counters.numel() < batch:
        counters = _ARRIVALS[device] = torch.zeros(max(batch, 64), dtype=torch.int32, device=device)
    return counters


def append_triton(t: LayerTensors, key: torch.Tensor, value: torch.Tensor, counts: Optional[torch.Tensor],
                  p: QuantParams) -> None:
    """Append key/value [B, H, n, D] in place, like append_reference (module doc). nuq levels come
    from t.k_levels / t.v_levels; t.rope_inv_freq plays no part in appends. A layer with a sink/OTT
    pool or the sparse outlier store is refused (ValueError): no kernel writes them (the
    dispatcher runs the decomposed append for such layers)."""
    if t.pool is not None:
        raise ValueError("append_triton does not take the sink/OTT token pool (the decomposed append "
                         "covers it)")
    if any(x is not None for x in (t.k_sparse, t.k_sparse_idx, t.v_sparse, t.v_sparse_idx)):
        raise ValueError("append_triton does not take the dense-and-sparse outlier store (the decomposed "
                         "append covers it)")
    B, H, S, D, R, RR, G, gv = check_cache(t, p)
    extras = check_kernel_extras(t, p)
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
    block_b = max(1, min(next_pow2(nbk), 2048 // (G * kper)))
    gb_p = next_pow2(gv // vper)
    block_tv = max(1, min(32, next_pow2(n), 2048 // (gb_p * vper)))
    d_p = next_pow2(D)
    block_tr = max(1, min(32, next_pow2(n), 4096 // d_p))
    wrap = torch.library.wrap_triton
    if n == 1:  # a decode step: one launch
        with device_ctx(k_codes):
            wrap(_append_decode_kernel)[(B * H,)](
                k_codes, k_scale, k_zero, k_res, v_codes, v_scale, v_zero, v_res, key, value, lengths, cnt,
                k_levels, v_levels, _arrival_counters(lengths.device, B),
                key.stride(0), key.stride(1), key.stride(3), value.stride(0), value.stride(1), value.stride(3),
                H, S, nsg,
                HAS_COUNTS=has_counts, HAS_LEVELS=has_levels, D=D, D_P=d_p, K_NB=nbk, K_BITS=k_bits, K_PER=kper,
                BLOCK_B=block_b, V_NB=nbv, V_NG=D // gv, V_BITS=v_bits, V_PER=vper, GV=gv, GB_P=gb_p, G=G, R=R,
                RR=RR, num_warps=4,
            )
        return
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
