"""Static-shape, data-independent cache attention (see decomposed_append.py for the rules these
forms follow): two forms of attend_reference that torch.compile, torch.export, ONNX and ExecuTorch trace.

Both attend over all S rows of the cache and mask by length and causality (keys/values before
nqk/nqv come from the codes, later ones from the residual windows, chosen per token with
torch.where). attend_fused (decode, q_len == 1) is a formulation Inductor on CPU compiles into
vectorized loops that read the packed uint8 codes directly, unpack them with shifts and masks
(never a table lookup) and reduce on the fly, so no dequantized copy of the cache is ever written.
attend_materialized (longer queries, every query in portable exports, and KVQuant's options)
dequantizes the cache once and uses matmuls. Rows of the cache past a sequence's length are read
but masked out with torch.where; they must hold finite values (KIVICache zero-initializes its
buffers and only ever writes finite ones for finite inputs).

At the dtype's limits (packing.py): attend_materialized saturates the dequantized keys/values to
the cache dtype's finite range like the reference's materialize_block; attend_fused folds scales
and zeros into its sums and sees the fp32 reconstruction unsaturated, like the reference's packed
domain (for fp16 at most scale/2 past 65504, finite in fp32). Both saturate the output to the
query dtype's range before the cast.
"""

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

# Longest token run one value-side accumulator sums before the chunks are added (see _token_chunk).
VALUE_CHUNK_TOKENS = 1024
# The fused decode form writes one reduction per query row (and per code in a byte, for values)
# up to this many accumulators; beyond it (long queries) one batched reduction.
MAX_SPLIT_ACCUMULATORS = 32


def unpack_codes_float(packed: Tensor, bits: int) -> Tensor:
    """packed uint8 [..., D*bits/8] -> fp32 codes [..., D] in channel order, with shifts and masks."""
    per = codes_per_word(bits)
    if per == 1:
        return packed.float()
    # (word >> (i * bits)) & mask as floor division and remainder: exact for words of <= 24 bits,
    # and core ATen ops the ONNX and ExecuTorch exporters take (shifts are not core ATen). This is
    # the form the exports use; the Inductor decode path (unpack_codes_ij) keeps the shifts it
    # vectorizes. 3-bit words are reassembled from their byte planes first (packing.unpack_words).
    if bits == 3:
        # In floats (packing.three_bit_codes_float): the integer division form of the other widths
        # compiles to code 10-17x slower at 3 bits (S = 4096, D = 64: 15 ms vs 0.9-1.5 ms).
        q = three_bit_codes_float(packed, -1)
        return q.reshape(*q.shape[:-2], q.shape[-2] * per)
    w = unpack_words(packed, bits)
    q = torch.stack([torch.remainder(torch.div(w, 2 ** (i * bits), rounding_mode="floor"), 2**bits)
                     for i in range(per)], -1)
    return q.reshape(*w.shape[:-1], w.shape[-1] * per).float()


# The decode kernels work in "byte-major" channel order: byte (word) j of a packed row holds
# channels d = j * per + i (i in [0, per)); viewing the channels as [per, D/per] (index i, j) makes
# the words j the innermost, contiguous axis, so a vectorized loop loads one packed row of uint8
# (3-bit: its three byte planes, packing.py) and shifts it by i * bits. Whatever is multiplied with
# the codes elementwise (query, key scales) is reordered the same way once per call.


def unpack_codes_ij(packed: Tensor, bits: int) -> Tensor:
    """packed uint8 [..., D*bits/8] -> fp32 codes [..., per, D/per]: [..., i, j] is channel j*per + i
    (per = codes_per_word(bits))."""
    per = codes_per_word(bits)
    if bits == 3 and packed.shape[-1] // 3 < FLOAT_UNPACK_BELOW_WORDS:
        # Fewer words a row than a vector has lanes (D < 128): Inductor's loop over them runs on
        # masked part-vectors, where the integer shifts cost 3-4x the float form below (fused
        # decode at D = 64, 4K tokens: ~7 ms vs ~2.4 ms; at D = 128 the shifts win, ~1.1 vs ~5 ms;
        # lab/three_bit_packing.py). Exact: 24-bit words are exact in fp32.
        return three_bit_codes_float(packed, -2)
    shifts = torch.arange(per, device=packed.device, dtype=torch.int32)[:, None] * bits
    return (torch.bitwise_right_shift(unpack_words(packed, bits)[..., None, :], shifts) & (2**bits - 1)).float()


# Inductor's CPU vectors hold 16 fp32 lanes (AVX-512); 3-bit rows of fewer words unpack in floats.
FLOAT_UNPACK_BELOW_WORDS = 16



def to_ij_order(x: Tensor, per: int) -> Tensor:
    """[..., D] channel order -> [..., per, D/per] byte-major order (see above), as a real copy:
    index_copy is a scatter, which Inductor materializes, so the loops that read the result see
    contiguous rows instead of a strided gather (a permuted view would be inlined as one)."""
    D = x.shape[-1]
    d = torch.arange(D, device=x.device)
    dest = (d % per) * (D // per) + torch.div(d, per, rounding_mode="floor")
    return torch.zeros_like(x).index_copy(-1, dest, x).view(*x.shape[:-1], per, D // per)


def from_ij_order(x: Tensor) -> Tensor:
    """[..., per, D/per] byte-major -> [..., D] channel order."""
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
    # unflatten rather than reshape: reshape's view check on the symbolic rows = groups * q
    # specializes a dynamic query length (torch.export).
    B, Hq, q, D = query.shape
    return out.unflatten(2, (Hq // out.shape[1], q)).reshape(B, Hq, q, D).to(query.dtype)


def _residual_slot_probs(p: Tensor, lengths: Tensor, nqv: Tensor, RR: int) -> Tensor:
    """Probability [B, H, rows, RR] of the token whose value sits in v_res slot s: the newest
    u = s (mod RR) below L, if it is exact (u >= nqv; 0 if there is none). RR: the ring's rows
    (R under kivi, R + G - 1 under ott, capped at S; schedule.py)."""
    B, H, rows, S = p.shape
    s = torch.arange(RR, device=p.device)
    u = lengths[:, None] - RR + mod_nonneg(s[None, :] - lengths[:, None], RR, S)  # [B, RR]
    idx = u.clamp(0, S - 1)[:, None, None, :].expand(B, H, rows, RR)
    exact = (u >= 0) & (u >= nqv[:, None])
    return torch.where(exact[:, None, None, :], torch.gather(p, -1, idx), torch.zeros((), device=p.device))


def _dot(a: Tensor, b: Tensor, dim: int) -> Tensor:
    """(a * b).sum(dim): a small contraction Inductor fuses into its loops (no BLAS call)."""
    return (a * b).sum(dim)


def _token_chunk(S: int) -> int:
    """Tokens per chunk of the value reduction. Inductor's CPU code uses a cascade-summation
    helper (an accumulator kept in memory) for fp32 sums longer than 4096, which turns the value
    loop into a store-forwarding chain (1.5x slower at S = 8192); chunks of at most
    VALUE_CHUNK_TOKENS tokens keep the accumulator in a register. The chunk must divide S; an S
    with no divisor in [VALUE_CHUNK_TOKENS / 8, VALUE_CHUNK_TOKENS] is summed whole."""
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
    """Decode form (plain KIVI and the pool; not KVQuant's options): reads the packed codes in fused loops, never a dequantized copy of the cache.

    Channels are in byte-major order (i, j) (see unpack_codes_ij); g = t // G; grp(j) is the
    value group of byte j. For each kv head, with rows = its query heads (x q_len):
      keys:   sq[r, t] = sum_{i,j} q[r,i,j] (c[t,i,j] s_k[g,i,j]) + sum_d q[r,d] z_k[g,d]
      values: acc[r,i,j] = sum_t p[r,t] (c[t,i,j] s_v[t,grp(j)] + z_v[t,grp(j)])
    Inductor (CPU) compiles each first term into one vectorized loop over the cache rows whose
    lanes are the bytes j of a packed row: load 16-64 bytes, shift by i * bits, mask, convert,
    scale, accumulate. The key zero term is a sum over D per group (S/G values, small); scores
    and probabilities ([rows, S] per head) are the only S-sized fp32 tensors written.

    Choices measured on Inductor's CPU code (lab/decomposed_attend_cpu.py):
    - the key scale multiplies the codes, not the query ((q s) . c): c * s is shared by the
      rows of a kv head, and k_scale is read once per token either way;
    - the value scale and zero dequantize the codes (p (c s + z)) rather than being folded into
      p: again shared by the rows, and the zero needs no separate pass over the tokens;
    - one sum per query row (and per code in a byte, for values) instead of one batched sum:
      Inductor fuses sums with the same loop ranges into one loop, so a cache row is unpacked
      once for all rows, and the value loop gets rows * per independent accumulators instead of
      a single serial add chain (end to end at the default shape, 1 thread: 5.2 -> 3.6 ms for
      the value split, 3.6 -> 3.1 ms for the key split);
    - query and key scales are reordered to (i, j) by a scatter (to_ij_order): a permuted view
      is inlined by Inductor as a strided gather that defeats vectorization;
    - the small contractions (q . z_k, q . k_res, p . v_res) are sums too, not matmuls, so the
      whole step is one Inductor kernel (a few percent faster than with BLAS calls);
    - token sums in chunks (_token_chunk).
    """
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

    # Keys: quantized part (used for t < nqk), exact residual window for t >= nqk.
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

    # Values: quantized part (t < nqv), then the residual window through its slots.
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
    """Prefill/chunk form, and every form with KVQuant's extras: dequantize all S rows once
    (fp32; nuq levels, exact sparse outliers, keys rotated when stored pre-RoPE) and use matmuls."""
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
