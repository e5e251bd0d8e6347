"""Static-shape forms of attend_reference that torch.compile, torch.export, ONNX and ExecuTorch trace
(rules: append.py): attend_fused (decode; Inductor CPU unpacks the codes in its loops) and
attend_materialized (dequantize once, matmuls). Rows past a sequence's length are read, then masked,
so they must hold finite values; saturation as in the reference (attend_reference)."""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ...options.extras import apply_key_outliers, apply_value_outliers, key_outliers_per_window
from ...layout import LayerTensors, QuantParams
from ..reference.packing import (code_values, codes_per_word, dequantize_float, saturate, three_bit_codes_float,
                                 token_group_size, unpack_words)
from ...options.pool import pool_attention_scores, pooled_mask_dense
from ...options.rope import rope_at
from .append import mod_nonneg
from ..reference import quantized_counts

VALUE_CHUNK_TOKENS = 1024
MAX_SPLIT_ACCUMULATORS = 32


def unpack_codes_float(packed: Tensor, bits: int) -> Tensor:
    """packed uint8 [..., D*bits/8] -> fp32 codes [..., D] in channel order, with shifts and masks."""
    per = codes_per_word(bits)
    if per == 1:
        return packed.float()
    # Division and remainder, not shifts: shifts are not core ATen (ONNX, ExecuTorch); exact to 24 bits.
    if bits == 3:
        # Floats: the integer form compiles 10-17x slower at 3 bits.
        q = three_bit_codes_float(packed, -1)
        return q.reshape(*q.shape[:-2], q.shape[-2] * per)
    w = unpack_words(packed, bits)
    q = torch.stack([torch.remainder(torch.div(w, 2 ** (i * bits), rounding_mode="floor"), 2**bits)
                     for i in range(per)], -1)
    return q.reshape(*w.shape[:-1], w.shape[-1] * per).float()


def unpack_codes_ij(packed: Tensor, bits: int) -> Tensor:
    """packed uint8 [..., D*bits/8] -> fp32 codes [..., per, D/per] in byte-major order: [..., i, j] is
    channel j*per + i, so the packed bytes j are the contiguous axis a vectorized loop loads."""
    per = codes_per_word(bits)
    if bits == 3 and packed.shape[-1] // 3 < FLOAT_UNPACK_BELOW_WORDS:
        # Part-vector loops (D < 128): shifts cost 3-4x the float form (docs/cache.md).
        return three_bit_codes_float(packed, -2)
    shifts = torch.arange(per, device=packed.device, dtype=torch.int32)[:, None] * bits
    return (torch.bitwise_right_shift(unpack_words(packed, bits)[..., None, :], shifts) & (2**bits - 1)).float()


FLOAT_UNPACK_BELOW_WORDS = 16



def to_ij_order(x: Tensor, per: int) -> Tensor:
    """[..., D] -> [..., per, D/per] byte-major, copied by a scatter: Inductor inlines a permuted view
    as a strided gather that defeats vectorization."""
    D = x.shape[-1]
    d = torch.arange(D, device=x.device)
    dest = (d % per) * (D // per) + torch.div(d, per, rounding_mode="floor")
    return torch.zeros_like(x).index_copy(-1, dest, x).view(*x.shape[:-1], per, D // per)


def from_ij_order(x: Tensor) -> Tensor:
    return x.transpose(-1, -2).reshape(*x.shape[:-2], x.shape[-1] * x.shape[-2])


def _attend_setup(query, lengths, counts, H, scale):
    B, Hq, q, D = query.shape
    groups = Hq // H
    counts = torch.full_like(lengths, q) if counts is None else counts.to(lengths.dtype)
    # [B, H, groups*q, D]: row r = g*q + i is query i of head h*groups + g.
    qf = query.float().reshape(B, H, groups * q, D) * scale
    i = torch.arange(q, device=query.device).repeat(groups)
    pos = (lengths - counts)[:, None] + i[None, :]  # [B, rows]: position of each query
    valid_row = i[None, :] < counts[:, None]
    return qf, pos, valid_row


def _softmax_rows(scores: Tensor, visible: Tensor):
    """Masked softmax numerators and denominators; fully masked rows give p = 0, denom = 0."""
    scores = torch.where(visible, scores, float("-inf"))
    m = scores.amax(dim=-1, keepdim=True)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    p = torch.exp(scores - m)
    return p, p.sum(dim=-1, keepdim=True)


def _finish(acc: Tensor, denom: Tensor, query: Tensor) -> Tensor:
    out = acc / denom.clamp(min=torch.finfo(torch.float32).tiny)
    out = saturate(torch.where(denom > 0, out, torch.zeros_like(out)), query.dtype)
    # unflatten, not reshape: reshape's view check specializes a dynamic query length (torch.export).
    B, Hq, q, D = query.shape
    return out.unflatten(2, (Hq // out.shape[1], q)).reshape(B, Hq, q, D).to(query.dtype)


def _residual_slot_probs(p: Tensor, lengths: Tensor, nqv: Tensor, RR: int) -> Tensor:
    """Probability [B, H, rows, RR] of the token in v_res slot s (0 if that token is quantized)."""
    B, H, rows, S = p.shape
    s = torch.arange(RR, device=p.device)
    u = lengths[:, None] - RR + mod_nonneg(s[None, :] - lengths[:, None], RR, S)  # [B, RR]
    idx = u.clamp(0, S - 1)[:, None, None, :].expand(B, H, rows, RR)
    exact = (u >= 0) & (u >= nqv[:, None])
    return torch.where(exact[:, None, None, :], torch.gather(p, -1, idx), torch.zeros((), device=p.device))


def _dot(a: Tensor, b: Tensor, dim: int) -> Tensor:
    return (a * b).sum(dim)


def _token_chunk(S: int) -> int:
    """A divisor of S of at most VALUE_CHUNK_TOKENS: Inductor keeps fp32 sums past 4096 in memory."""
    if S <= VALUE_CHUNK_TOKENS:
        return S
    for T in range(VALUE_CHUNK_TOKENS, VALUE_CHUNK_TOKENS // 8 - 1, -1):
        if S % T == 0:
            return T
    return S


def _with_pool(scores: Tensor, visible: Tensor, qf: Tensor, pos: Tensor, valid_row: Tensor, pool,
               rope_inv_freq: Optional[Tensor] = None):
    """Mask pooled tokens out of scores/visible [B, H|1, rows, S] and append the pool's columns."""
    if pool is None:
        return scores, visible
    pool_k, _, pool_pos = pool
    B, H, rows, S = scores.shape
    visible = visible & ~pooled_mask_dense(pool_pos, S)[:, :, None, :]
    ps, pvis = pool_attention_scores(qf, pool_k, pool_pos, pos, valid_row, rope_inv_freq)
    return torch.cat([scores, ps], dim=-1), torch.cat([visible.expand(B, H, rows, S), pvis], dim=-1)


def _pool_values(p: Tensor, S: int, pool) -> tuple[Tensor, Optional[Tensor]]:
    """Split probabilities into the cache's S columns and the pool's contribution [B, H, rows, D]."""
    if pool is None:
        return p, None
    return p[..., :S], _dot(p[..., S:, None], pool[1].float()[:, :, None], -2)


def attend_fused(query: Tensor, layer: LayerTensors, counts: Optional[Tensor], params: QuantParams, scale: float) -> Tensor:
    """Decode form (plain KIVI and the pool): reads the packed codes in fused loops, never a dequantized
    copy of the cache; its formulation choices are in docs/performance.md (Decode attention)."""
    k_codes, k_scale, k_zero, k_res, v_codes, v_scale, v_zero, v_res, lengths = layer.kivi
    k_bits, v_bits, G, R = params[:4]
    pool = layer.pool
    B, Hq, q, D = query.shape
    H, S, RR = k_codes.shape[1], k_codes.shape[2], k_res.shape[2]
    device = query.device
    qf, pos, valid_row = _attend_setup(query, lengths, counts, H, scale)
    rows = qf.shape[2]
    nqk, nqv = quantized_counts(lengths, R, G, params.flush_policy)
    t = torch.arange(S, device=device)
    g = torch.div(t, G, rounding_mode="floor")
    zero = torch.zeros((), device=device)

    qp = to_ij_order(qf, codes_per_word(k_bits))  # [B, H, rows, per, D/per]
    ks = to_ij_order(k_scale.float(), codes_per_word(k_bits))  # [B, H, S/G, per, D/per]
    kdq = unpack_codes_ij(k_codes, k_bits) * ks[:, :, g]  # [B, H, S, per, D/per], fused
    if rows <= MAX_SPLIT_ACCUMULATORS:
        sq = torch.stack([(qp[:, :, r, None] * kdq).sum((-1, -2)) for r in range(rows)], 2)
    else:
        sq = (qp[:, :, :, None] * kdq[:, :, None]).sum((-1, -2))
    sq = sq + _dot(qf[:, :, :, None, :], k_zero.float()[:, :, None], -1)[..., g]  # [B, H, rows, S]
    sr = _dot(qf[:, :, :, None, :], k_res.float()[:, :, None], -1)  # [B, H, rows, RR]
    scores = torch.where((t[None, :] < nqk[:, None])[:, None, None, :], sq, sr[..., t % RR])
    visible = ((t[None, None, :] <= pos[:, :, None]) & valid_row[:, :, None])[:, None]
    p, denom = _softmax_rows(*_with_pool(scores, visible, qf, pos, valid_row, pool))
    p, pool_acc = _pool_values(p, S, pool)

    pq = torch.where((t[None, :] < nqv[:, None])[:, None, None, :], p, zero)  # [B, H, rows, S]
    vp = codes_per_word(v_bits)
    gv = token_group_size(G, D)
    jgrp = torch.div(torch.arange(D // vp, device=device), gv // vp, rounding_mode="floor")
    vdq = (unpack_codes_ij(v_codes, v_bits) * v_scale.float()[:, :, :, None, jgrp]
           + v_zero.float()[:, :, :, None, jgrp])  # [B, H, S, per, D/per], fused
    T = _token_chunk(S)
    pc = pq.view(B, H, rows, S // T, T).transpose(2, 3)  # [B, H, S/T, rows, T]
    vdq = vdq.view(B, H, S // T, T, vp, D // vp)
    if rows * vp <= MAX_SPLIT_ACCUMULATORS:
        acc = torch.stack([torch.stack([(pc[:, :, :, r, :, None] * vdq[:, :, :, :, i]).sum(3) for i in range(vp)], -2)
                           for r in range(rows)], 2)  # [B, H, rows, S/T, per, D/per]
        acc = acc.sum(3)
    else:
        acc = (pc[..., None, None] * vdq[:, :, :, None]).sum(4).sum(2)
    acc = from_ij_order(acc)  # [B, H, rows, D]
    acc = acc + _dot(_residual_slot_probs(p, lengths, nqv, RR)[..., None], v_res.float()[:, :, None], -2)
    if pool_acc is not None:
        acc = acc + pool_acc
    return _finish(acc, denom, query)


def attend_materialized(query: Tensor, layer: LayerTensors, counts: Optional[Tensor], params: QuantParams,
                        scale: float) -> Tensor:
    """Prefill/chunk form, and every form with KVQuant's extras: dequantize all S rows once, matmuls."""
    k_codes, k_scale, k_zero, k_res, v_codes, v_scale, v_zero, v_res, lengths = layer.kivi
    k_bits, v_bits, G, R = params[:4]
    pool, extras = layer.pool, layer.extras
    B, Hq, q, D = query.shape
    H, S = k_codes.shape[1], k_codes.shape[2]
    qf, pos, valid_row = _attend_setup(query, lengths, counts, H, scale)
    nqk, nqv = quantized_counts(lengths, R, G, params.flush_policy)
    t = torch.arange(S, device=query.device)
    g = torch.div(t, G, rounding_mode="floor")
    gv = token_group_size(G, D)
    dgrp = torch.div(torch.arange(D, device=query.device), gv, rounding_mode="floor")
    slot = t % k_res.shape[2]  # the residual ring (schedule.py)
    keys = saturate(dequantize_float(code_values(unpack_codes_float(k_codes, k_bits), extras.k_levels),
                                     k_scale[:, :, g], k_zero[:, :, g]), k_res.dtype)
    values = saturate(dequantize_float(code_values(unpack_codes_float(v_codes, v_bits), extras.v_levels),
                                       v_scale[..., dgrp], v_zero[..., dgrp]), v_res.dtype)
    if extras.sparse:
        nk = key_outliers_per_window(extras.k_sparse, S, R)
        keys = apply_key_outliers(keys, 0, extras.k_sparse, extras.k_sparse_idx, nk, R)
        values = apply_value_outliers(values, extras.v_sparse, extras.v_sparse_idx)
    keys = torch.where((t[None, :] < nqk[:, None])[:, None, :, None], keys, k_res.float()[:, :, slot])
    values = torch.where((t[None, :] < nqv[:, None])[:, None, :, None], values, v_res.float()[:, :, slot])
    if extras.rope_inv_freq is not None:
        keys = rope_at(keys, t, extras.rope_inv_freq)
    scores = qf @ keys.transpose(-1, -2)  # [B, H, rows, S]
    visible = ((t[None, None, :] <= pos[:, :, None]) & valid_row[:, :, None])[:, None]
    p, denom = _softmax_rows(*_with_pool(scores, visible, qf, pos, valid_row, pool, extras.rope_inv_freq))
    p, pool_acc = _pool_values(p, S, pool)
    acc = p @ values
    return _finish(acc if pool_acc is None else acc + pool_acc, denom, query)
