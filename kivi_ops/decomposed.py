"""Static-shape, data-independent formulations of the two cache ops (cache_append, cache_attend).

The CPU references in cache_reference.py loop over sequences in Python, read lengths/counts on
the host (`.tolist()`, `int(tensor)`) and slice by them, so torch.export, ONNX, ExecuTorch and
Inductor cannot trace them. The functions here compute the same thing with tensor ops whose
shapes depend only on the buffer and input shapes (B, H, n, D, S, R, G, bits), never on the
lengths or counts: indices are computed from tensors and used with gather / advanced indexing /
index_put_, choices are torch.where. No host sync, no data-dependent shapes, no Python branch
on a tensor value. Cache layout and streaming policy: see cache_reference.py.

cache_append_decomposed writes exactly what cache_append_reference writes, bit for bit, on every
slot of every buffer (slots the policy does not touch are rewritten with their old contents).
Capacity is not checked (that needs a host sync): the caller must not append past max_seq_len.
If it does, nothing raises; rows are written modulo the buffer sizes and the cache is garbage.

cache_attend_decomposed attends over all S rows of the cache and masks by length and causality
(keys/values before nqk/nqv come from the codes, later ones from the residual windows, chosen per
token with torch.where). Decode (q_len == 1) uses a formulation Inductor on CPU compiles into
vectorized loops that read the packed uint8 codes directly, unpack them with shifts and masks
(never a table lookup) and reduce on the fly, so no dequantized copy of the cache is ever
written (see _attend_fused). Longer queries (prefill, chunks) dequantize the cache once and use
matmuls (_attend_materialized). Rows of the cache past a sequence's length are read but masked
out with torch.where; they must hold finite values (KIVICache zero-initializes its buffers and
only ever writes finite ones for finite inputs).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .cache_reference import quantized_counts
from .extras import (NO_EXTRAS, Extras, apply_key_outliers, apply_value_outliers, key_outliers_per_window,
                     select_key_outliers, select_outliers)
from .packing import code_values, codes_per_byte, quantize_pack_reference, token_group_size
from .pool import ott_step, pool_attention_scores, pooled_mask_dense, replace_pooled_rows
from .rope import rope_at


# Longest token run one value-side accumulator sums before the chunks are added (see _token_chunk).
VALUE_CHUNK_TOKENS = 1024
# The fused decode form writes one reduction per query row (and per code in a byte, for values)
# up to this many accumulators; beyond it (long queries) one batched reduction.
MAX_SPLIT_ACCUMULATORS = 32



def _mod_nonneg(x: Tensor, m: int, bound: int) -> Tensor:
    """x mod m for integer x >= -bound, computed on a non-negative operand: ExecuTorch's portable
    remainder kernel does not follow Python's sign convention for negative operands."""
    return torch.remainder(x + m * (bound // m + 2), m)


def _bh_index(B: int, H: int, device) -> tuple[Tensor, Tensor]:
    """Broadcastable batch [B, 1, 1] and head [1, H, 1] indices for buf[b, h, rows[:, None, :]]."""
    return (torch.arange(B, device=device)[:, None, None], torch.arange(H, device=device)[None, :, None])


def _write_rows(buf: Tensor, bi: Tensor, hi: Tensor, rows: Tensor, new: Tensor, valid: Tensor) -> None:
    """buf[b, h, rows[b, j]] = new[b, h, j] where valid[b, j], else rewritten unchanged.

    rows [B, W] must be distinct within each row b (no scatter conflicts), new [B, H, W, X]."""
    r = rows[:, None, :]
    old = buf[bi, hi, r]
    # ONNX Runtime has no int16 Where (the sparse store's indices): choose in int32, store back.
    wide = torch.int32 if buf.dtype == torch.int16 else buf.dtype
    buf.index_put_((bi, hi, r), torch.where(valid[:, None, :, None], new.to(wide), old.to(wide)).to(buf.dtype))


def _take_tokens(x: Tensor, bi: Tensor, hi: Tensor, idx: Tensor) -> Tensor:
    """x[b, h, idx[b, j]] -> [B, H, W, D] (idx already clamped in range)."""
    return x[bi, hi, idx[:, None, :]]


def cache_append_decomposed(
    k_codes: Tensor, k_scale: Tensor, k_zero: Tensor, k_res: Tensor,
    v_codes: Tensor, v_scale: Tensor, v_zero: Tensor, v_res: Tensor, lengths: Tensor,
    key: Tensor, value: Tensor, counts: Optional[Tensor],
    k_bits: int, v_bits: int, group_size: int, residual_length: int, pool=None, extras: Extras = NO_EXTRAS,
) -> None:
    """cache_append_reference without host syncs or data-dependent shapes (mutates the 9 buffers,
    and the pool's 3 when pool = (pool_k, pool_v, pool_pos, sink_tokens, outlier_tokens), see pool.py,
    and the sparse outlier store when extras has one, see extras.py).

    key/value [B, H, n, D]; row b's first counts[b] tokens are real (all n if counts is None).
    Per sequence b with L = lengths[b] stored tokens, c new ones and end = L + c:

    keys: the stream of tokens u = nqk + j (nqk = L // R * R) is k_res[j] for u < L and
        key[u - L] for L <= u < end. Its first W tokens (W = the most whole R-windows n new tokens
        can complete, capped by S) are quantized per channel window by window; windows below
        end // R * R are written to rows (nqk + j) % S, the others rewrite the old rows (the rows
        are distinct since W <= S). The residual slot s then holds token nqk_end + s if it is new.
    values: tokens u in [q0, q1) = [max(L - R, 0), max(end - R, 0)) leave the window (at most n):
        j in [0, min(n, S)), u = q0 + j, read from v_res[u % R] (u < L) or value[u - L], quantized
        per token, written to rows u % S where u < q1. Slot s of v_res holds the newest token
        u = s (mod R) below end if that token is new.
    """
    B, H, n, D = key.shape
    R, G = residual_length, group_size
    S, RR = k_codes.shape[2], k_res.shape[2]
    device = key.device
    bi, hi = _bh_index(B, H, device)
    L = lengths
    c = torch.full_like(L, n) if counts is None else counts.to(L.dtype)
    end = L + c
    symbolic = isinstance(n, torch.SymInt)
    if symbolic:
        # A dynamic token count (one exported program for prompts and decode steps), which the
        # exporter bounds to 1 <= n <= S: the min/max below are n - 1 and n without clamping, so
        # no symbolic min/max reaches the graph (ExecuTorch rejects those Python-level ops).
        last_new = n - 1
    else:
        last_new = max(n - 1, 0)

    if pool is not None:
        pool_k, pool_v, pool_pos, sink, n_out = pool
        pk, pv, ppos = pool_k, pool_v, pool_pos
        if sink > 0 and n > 0:  # sink slot s takes the token at position s if it is new
            s = torch.arange(sink, device=device)
            take = (s[None, :] >= L[:, None]) & (s[None, :] < end[:, None])  # [B, sink]
            idx = (s[None, :] - L[:, None]).clamp(0, last_new)
            tk = take[:, None, :, None]
            pk = torch.cat([torch.where(tk, _take_tokens(key, bi, hi, idx), pk[:, :, :sink]), pk[:, :, sink:]], 2)
            pv = torch.cat([torch.where(tk, _take_tokens(value, bi, hi, idx), pv[:, :, :sink]), pv[:, :, sink:]], 2)
            ppos = torch.cat([torch.where(take[:, None, :], s[None, None, :], ppos[:, :, :sink]), ppos[:, :, sink:]], 2)

    # ---- keys: quantize the whole R-windows the append completes.
    nqk = torch.div(L, R, rounding_mode="floor") * R
    nqk_end = torch.div(end, R, rounding_mode="floor") * R
    # A symbolic n would make the window count symbolic, and shape reasoning would specialize on
    # whether it is 1; the traced program instead always quantizes the S // R windows it could
    # ever flush (about the cost of the materialized attention it runs anyway).
    windows = S // R if symbolic else min((R - 1 + n) // R, S // R)
    W = windows * R  # static: most tokens one append can flush
    if W > 0 and n > 0:
        j = torch.arange(W, device=device)
        u = nqk[:, None] + j[None, :]  # [B, W]
        from_res = u < L[:, None]
        old_part = k_res[:, :, j.clamp(max=RR - 1)]  # slot of u < L is u % R = j (nqk % R == 0)
        new_part = _take_tokens(key, bi, hi, (u - L[:, None]).clamp(0, last_new))
        stream = torch.where(from_res[:, None, :, None], old_part.expand(B, H, W, D), new_part)
        flushed = (nqk_end - nqk)[:, None]
        if pool is not None:
            pooled = (u < sink)[:, None, :].expand(B, H, W)
            if n_out > 0:
                a, z = sink, sink + n_out
                v_old = v_res[:, :, j.clamp(max=RR - 1)]  # value slot of u < L is u % R = j too
                v_new = _take_tokens(value, bi, hi, (u - L[:, None]).clamp(0, last_new))
                v_stream = torch.where(from_res[:, None, :, None], v_old.expand(B, H, W, D), v_new)
                state = (pk[:, :, a:z], pv[:, :, a:z], ppos[:, :, a:z], pk[:, :, z:], pv[:, :, z:], ppos[:, :, z:])
                entrants = []
                for w in range(windows):  # OTT steps, window by window (pool.py)
                    win = slice(w * R, (w + 1) * R)
                    *state, entered = ott_step(*state, stream[:, :, win], v_stream[:, :, win], u[:, win],
                                               u[:, win] >= sink, w * R < flushed[:, 0])
                    entrants.append(entered)
                pooled = pooled | torch.cat(entrants, dim=2)
                pk = torch.cat([pk[:, :, :a], state[0], state[3]], 2)
                pv = torch.cat([pv[:, :, :a], state[1], state[4]], 2)
                ppos = torch.cat([ppos[:, :, :a], state[2], state[5]], 2)
            stream = replace_pooled_rows(stream, pooled, G)
        exclude = None
        nk = key_outliers_per_window(extras.k_sparse, S, R) if extras.sparse else 0
        if nk:  # dense-and-sparse: per channel, the window's largest keys stay exact
            exclude, vals, idx = select_key_outliers(stream, nk, R)
            oj = torch.arange(windows * nk, device=device)
            orows = (torch.div(nqk, R, rounding_mode="floor")[:, None] * nk + oj[None, :]) % extras.k_sparse.shape[2]
            ovalid = torch.div(oj, nk, rounding_mode="floor")[None, :] * R < flushed
            _write_rows(extras.k_sparse, bi, hi, orows, vals, ovalid)
            _write_rows(extras.k_sparse_idx, bi, hi, orows, idx, ovalid)
        codes, scale, zero = quantize_pack_reference(stream, k_bits, G, "channel", extras.k_levels, exclude)
        _write_rows(k_codes, bi, hi, u % S, codes, j[None, :] < flushed)
        gj = torch.arange(W // G, device=device)
        grows = (torch.div(nqk, G, rounding_mode="floor")[:, None] + gj[None, :]) % k_scale.shape[2]
        gvalid = gj[None, :] * G < flushed
        _write_rows(k_scale, bi, hi, grows, scale, gvalid)
        _write_rows(k_zero, bi, hi, grows, zero, gvalid)

    # ---- values: quantize per token the tokens leaving the window of the last R.
    NV = n if symbolic else min(n, S)
    q0 = (L - R).clamp(min=0)
    q1 = (end - R).clamp(min=0)
    if NV > 0 and S > R:  # with S <= R no value ever leaves the window
        j = torch.arange(NV, device=device)
        u = q0[:, None] + j[None, :]  # [B, NV]
        from_win = u < L[:, None]
        win = _take_tokens(v_res, bi, hi, (u % R).clamp(max=RR - 1))
        new = _take_tokens(value, bi, hi, (u - L[:, None]).clamp(0, last_new))
        leaving = torch.where(from_win[:, None, :, None], win, new)
        valid = u < q1[:, None]
        rows = u % S
        exclude = None
        if extras.sparse:  # dense-and-sparse: per token, the largest channels stay exact
            exclude, vals, idx = select_outliers(leaving, extras.v_sparse.shape[-1], dim=-1)
            _write_rows(extras.v_sparse, bi, hi, rows, vals, valid)
            _write_rows(extras.v_sparse_idx, bi, hi, rows, idx, valid)
        codes, scale, zero = quantize_pack_reference(leaving, v_bits, G, "token", extras.v_levels, exclude)
        _write_rows(v_codes, bi, hi, rows, codes, valid)
        _write_rows(v_scale, bi, hi, rows, scale, valid)
        _write_rows(v_zero, bi, hi, rows, zero, valid)

    # ---- residuals, rebuilt whole (RR slots) after every read of the old ones above.
    if n > 0:
        s = torch.arange(RR, device=device)
        u = nqk_end[:, None] + s[None, :]  # keys: slot s holds token nqk_end + s
        take = (u >= L[:, None]) & (u < end[:, None])
        new = _take_tokens(key, bi, hi, (u - L[:, None]).clamp(0, last_new))
        k_res.copy_(torch.where(take[:, None, :, None], new, k_res))
        u = end[:, None] - R + _mod_nonneg(s[None, :] - end[:, None], R, S)  # values: newest u = s mod R below end
        take = u >= L[:, None]
        new = _take_tokens(value, bi, hi, (u - L[:, None]).clamp(0, last_new))
        v_res.copy_(torch.where(take[:, None, :, None], new, v_res))

    if pool is not None and pool_pos.shape[2] > 0:
        pool_k.copy_(pk)
        pool_v.copy_(pv)
        pool_pos.copy_(ppos)
    lengths.add_(c)


# ---------------------------------------------------------------- attention


def unpack_codes_float(packed: Tensor, bits: int) -> Tensor:
    """packed uint8 [..., D*bits/8] -> fp32 codes [..., D] in channel order, with shifts and masks."""
    per = codes_per_byte(bits)
    if per == 1:
        return packed.float()
    # (byte >> (i * bits)) & mask as floor division and remainder: exact for bytes, and core ATen
    # ops the ONNX and ExecuTorch exporters take (shifts are not core ATen). This is the form the
    # exports use; the Inductor decode path (unpack_codes_ij) keeps the shifts it vectorizes.
    place = 2 ** (torch.arange(per, device=packed.device, dtype=torch.int32) * bits)
    q = torch.remainder(torch.div(packed.to(torch.int32)[..., None], place, rounding_mode="floor"), 2**bits)
    return q.reshape(*packed.shape[:-1], packed.shape[-1] * per).float()


# The decode kernels work in "byte-major" channel order: byte j of a packed row holds channels
# d = j * per + i (i in [0, per)); viewing the channels as [per, D/per] (index i, j) makes the
# bytes j the innermost, contiguous axis, so a vectorized loop loads one packed row of uint8 and
# shifts it by i * bits. Whatever is multiplied with the codes elementwise (query, key scales) is
# reordered the same way once per call.


def unpack_codes_ij(packed: Tensor, bits: int) -> Tensor:
    """packed uint8 [..., D/per] -> fp32 codes [..., per, D/per]: [..., i, j] is channel j*per + i."""
    per = codes_per_byte(bits)
    shifts = torch.arange(per, device=packed.device, dtype=torch.int32)[:, None] * bits
    return (torch.bitwise_right_shift(packed.to(torch.int32)[..., None, :], shifts) & (2**bits - 1)).float()


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
    out = torch.where(denom > 0, out, torch.zeros_like(out))
    # unflatten rather than reshape: reshape's view check on the symbolic rows = groups * q
    # specializes a dynamic query length (torch.export).
    B, Hq, q, D = query.shape
    return out.unflatten(2, (Hq // out.shape[1], q)).reshape(B, Hq, q, D).to(query.dtype)


def _residual_slot_probs(p: Tensor, lengths: Tensor, R: int, RR: int) -> Tensor:
    """Probability [B, H, rows, RR] of the token whose value sits in v_res slot s: the newest
    u = s (mod R) below L, from the last min(L, R) tokens (0 if there is none)."""
    B, H, rows, S = p.shape
    s = torch.arange(RR, device=p.device)
    u = lengths[:, None] - R + _mod_nonneg(s[None, :] - lengths[:, None], R, S)  # [B, RR]
    idx = u.clamp(0, S - 1)[:, None, None, :].expand(B, H, rows, RR)
    return torch.where((u >= 0)[:, None, None, :], torch.gather(p, -1, idx), torch.zeros((), device=p.device))


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


def _attend_fused(query, k_codes, k_scale, k_zero, k_res, v_codes, v_scale, v_zero, v_res, lengths, counts,
                  k_bits, v_bits, group_size, residual_length, scale, pool=None):
    """Decode form: reads the packed codes in fused loops, never a dequantized copy of the cache.

    Channels are in byte-major order (i, j) (see unpack_codes_ij); g = t // G; grp(j) is the
    value group of byte j. For each kv head, with rows = its query heads (x q_len):
      keys:   sq[r, t] = sum_{i,j} q[r,i,j] (c[t,i,j] s_k[g,i,j]) + sum_d q[r,d] z_k[g,d]
      values: acc[r,i,j] = sum_t p[r,t] (c[t,i,j] s_v[t,grp(j)] + z_v[t,grp(j)])
    Inductor (CPU) compiles each first term into one vectorized loop over the cache rows whose
    lanes are the bytes j of a packed row: load 16-64 bytes, shift by i * bits, mask, convert,
    scale, accumulate. The key zero term is a sum over D per group (S/G values, small); scores
    and probabilities ([rows, S] per head) are the only S-sized fp32 tensors written.

    Choices measured on Inductor's CPU code (benchmarks/decomposed_attend_cpu.py):
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
    B, Hq, q, D = query.shape
    H, S, RR = k_codes.shape[1], k_codes.shape[2], k_res.shape[2]
    R, G = residual_length, group_size
    device = query.device
    qf, pos, valid_row = _attend_setup(query, lengths, counts, H, scale)
    rows = qf.shape[2]
    nqk, nqv = quantized_counts(lengths, R)
    t = torch.arange(S, device=device)
    g = torch.div(t, G, rounding_mode="floor")
    zero = torch.zeros((), device=device)

    # Keys: quantized part (used for t < nqk), exact residual window for t >= nqk.
    qp = to_ij_order(qf, codes_per_byte(k_bits))  # [B, H, rows, per, D/per]
    ks = to_ij_order(k_scale.float(), codes_per_byte(k_bits))  # [B, H, S/G, per, D/per]
    kdq = unpack_codes_ij(k_codes, k_bits) * ks[:, :, g]  # [B, H, S, per, D/per], fused
    if rows <= MAX_SPLIT_ACCUMULATORS:
        sq = torch.stack([(qp[:, :, r, None] * kdq).sum((-1, -2)) for r in range(rows)], 2)
    else:
        sq = (qp[:, :, :, None] * kdq[:, :, None]).sum((-1, -2))
    sq = sq + _dot(qf[:, :, :, None, :], k_zero.float()[:, :, None], -1)[..., g]  # [B, H, rows, S]
    sr = _dot(qf[:, :, :, None, :], k_res.float()[:, :, None], -1)  # [B, H, rows, RR]
    scores = torch.where((t[None, :] < nqk[:, None])[:, None, None, :], sq, sr[..., t % R])
    visible = ((t[None, None, :] <= pos[:, :, None]) & valid_row[:, :, None])[:, None]
    p, denom = _softmax_rows(*_with_pool(scores, visible, qf, pos, valid_row, pool))
    p, pool_acc = _pool_values(p, S, pool)

    # Values: quantized part (t < nqv), then the residual window through its slots.
    pq = torch.where((t[None, :] < nqv[:, None])[:, None, None, :], p, zero)  # [B, H, rows, S]
    vp = codes_per_byte(v_bits)
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
    acc = acc + _dot(_residual_slot_probs(p, lengths, R, RR)[..., None], v_res.float()[:, :, None], -2)
    if pool_acc is not None:
        acc = acc + pool_acc
    return _finish(acc, denom, query)


def _attend_materialized(query, k_codes, k_scale, k_zero, k_res, v_codes, v_scale, v_zero, v_res, lengths, counts,
                         k_bits, v_bits, group_size, residual_length, scale, pool=None, extras: Extras = NO_EXTRAS):
    """Prefill/chunk form, and every form with KVQuant's extras: dequantize all S rows once
    (fp32; nuq levels, exact sparse outliers, keys rotated when stored pre-RoPE) and use matmuls."""
    B, Hq, q, D = query.shape
    H, S, RR = k_codes.shape[1], k_codes.shape[2], k_res.shape[2]
    R, G = residual_length, group_size
    qf, pos, valid_row = _attend_setup(query, lengths, counts, H, scale)
    nqk, nqv = quantized_counts(lengths, R)
    t = torch.arange(S, device=query.device)
    g = torch.div(t, G, rounding_mode="floor")
    gv = token_group_size(G, D)
    dgrp = torch.div(torch.arange(D, device=query.device), gv, rounding_mode="floor")
    slot = t % R
    keys = (code_values(unpack_codes_float(k_codes, k_bits), extras.k_levels) * k_scale.float()[:, :, g]
            + k_zero.float()[:, :, g])
    values = (code_values(unpack_codes_float(v_codes, v_bits), extras.v_levels) * v_scale.float()[..., dgrp]
              + v_zero.float()[..., dgrp])
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


def cache_attend_decomposed(
    query: Tensor,
    k_codes: Tensor, k_scale: Tensor, k_zero: Tensor, k_res: Tensor,
    v_codes: Tensor, v_scale: Tensor, v_zero: Tensor, v_res: Tensor, lengths: Tensor,
    counts: Optional[Tensor],
    k_bits: int, v_bits: int, group_size: int, residual_length: int, scale: float,
    *, form: str = "auto", pool=None, extras: Extras = NO_EXTRAS,
) -> Tensor:
    """cache_attend_reference with static shapes: query [B, Hq, q, D] -> [B, Hq, q, D].

    Causal (query i of row b sits at lengths[b] - counts[b] + i), GQA (head h -> kv head
    h // (Hq / H)), rows i >= counts[b] return zeros. form: "fused" (decode formulation, no
    dequantized copy of the cache), "materialized" (dequantize + matmul) or "auto" (fused for
    q_len == 1, materialized otherwise). KVQuant's extras (extras.py) run in the materialized form.
    """
    if form == "auto":
        form = "fused" if query.shape[2] == 1 and not extras.active else "materialized"
    if form == "fused":
        if extras.active:
            raise ValueError("form='fused' does not support nuq levels, sparse outliers or pre-RoPE keys; "
                             "use form='materialized' or 'auto'")
        return _attend_fused(query, k_codes, k_scale, k_zero, k_res, v_codes, v_scale, v_zero, v_res, lengths,
                             counts, k_bits, v_bits, group_size, residual_length, scale, pool=pool)
    if form != "materialized":
        raise ValueError(f"form must be 'auto', 'fused' or 'materialized', got {form!r}")
    return _attend_materialized(query, k_codes, k_scale, k_zero, k_res, v_codes, v_scale, v_zero, v_res, lengths,
                                counts, k_bits, v_bits, group_size, residual_length, scale, pool=pool, extras=extras)
