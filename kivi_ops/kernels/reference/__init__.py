"""Reference (plain PyTorch) cache append and attention, static and paged: the CPU kernels and the
specification the other implementations are tested against. Per-sequence loops and host reads of
the lengths: simple to read, impossible to trace. The paged forms run the static code on each row's
gathered pages and write back the pages the append wrote, so they give the same bits."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ...options.extras import (apply_key_outliers, apply_value_outliers, key_outliers_per_window, select_key_outliers,
                               select_outliers)
from ...layout import LayerTensors, QuantParams
from ...paged_layout import PAGED_TENSORS, Paging, static_view
from .packing import (code_values, dequantize_float, expand_groups, quantize_pack_reference, saturate, unpack,
                      unpack_float)
from ...options.pool import ott_step, pool_attention_scores, pooled_mask
from ...options.rope import rope_at
from ...options.schedule import OTT, quantized_count_int, quantized_counts  # noqa: F401 (quantized_counts: re-exported)

# Tokens per online-softmax step: bounds the temporary dequantized block.
ATTEND_BLOCK_TOKENS = 1024




def check_capacity(lengths: torch.Tensor, counts, n: int, max_seq_len: int) -> None:
    """Raise before anything is written if a sequence would grow past max_seq_len (host sync)."""
    added = torch.full_like(lengths, n) if counts is None else counts.to(lengths.dtype)
    over = (lengths + added > max_seq_len).nonzero()
    if len(over):
        b = int(over[0])
        raise ValueError(
            f"the cache is full: sequence {b} holds {int(lengths[b])} tokens and appending "
            f"{int(added[b])} would exceed max_seq_len={max_seq_len}"
        )


def append_reference(layer: LayerTensors, key, value, counts, params: QuantParams) -> None:
    """Append key/value [B, H, n, D] in place (the first counts[b] tokens of row b are real)."""
    k_codes, k_scale, k_zero, k_res, v_codes, v_scale, v_zero, v_res, lengths = layer.kivi
    k_bits, v_bits, group_size, residual_length = params[:4]
    pool, extras = params.pool_args(layer), layer.extras
    B, H, n, D = key.shape
    R, G = residual_length, group_size
    S = k_codes.shape[2]
    nk = key_outliers_per_window(extras.k_sparse, S, R) if extras.sparse else 0
    check_capacity(lengths, counts, n, S)
    counts_list = [n] * B if counts is None else counts.tolist()
    lengths_list = lengths.tolist()
    for b in range(B):
        L, c = lengths_list[b], counts_list[b]
        if c == 0:
            continue
        new_k, new_v = key[b, :, :c], value[b, :, :c]
        end = L + c
        if params.flush_policy == OTT:
            _append_row_ott(layer, params, pool, b, L, new_k, new_v)
            continue

        nqk, nqk_end = L // R * R, end // R * R
        if pool is not None:
            _pool_sinks(pool, b, L, end, new_k, new_v)
        if nqk_end > nqk:
            stream = torch.cat([k_res[b, :, : L - nqk], new_k], dim=1)
            flushed = stream[:, : nqk_end - nqk]
            pooled = exclude = None
            if pool is not None:
                v_stream = torch.cat([v_res[b][:, torch.arange(nqk, L, device=key.device) % R], new_v], dim=1)
                pooled = _pool_flush(pool, b, nqk, nqk_end, flushed, v_stream[:, : nqk_end - nqk], R)
                exclude = pooled[:, :, None].expand(flushed.shape)
            if nk:
                outliers, vals, idx = select_key_outliers(flushed[None], nk, R, None if pooled is None else pooled[None])
                rows = slice(nqk // R * nk, nqk_end // R * nk)
                extras.k_sparse[b, :, rows], extras.k_sparse_idx[b, :, rows] = vals[0], idx[0]
                exclude = outliers[0] if exclude is None else exclude | outliers[0]
            codes, scale, zero = quantize_pack_reference(flushed, k_bits, G, "channel", extras.k_levels, exclude)
            k_codes[b, :, nqk:nqk_end] = codes
            k_scale[b, :, nqk // G : nqk_end // G] = scale
            k_zero[b, :, nqk // G : nqk_end // G] = zero
            rest = stream[:, nqk_end - nqk :]
            k_res[b, :, : rest.shape[1]] = rest
        else:
            k_res[b, :, L - nqk : end - nqk] = new_k

        # Values leaving the window are read before they are overwritten.
        q0, q1 = max(L - R, 0), max(end - R, 0)
        if q1 > q0:
            u = torch.arange(q0, q1, device=key.device)
            from_window = v_res[b][:, u.clamp(max=L - 1) % R]
            from_new = new_v[:, (u - L).clamp(min=0)]
            leaving = torch.where((u < L)[None, :, None], from_window, from_new)
            exclude = None
            if extras.sparse:
                exclude, vals, idx = select_outliers(leaving, extras.v_sparse.shape[-1], dim=-1)
                extras.v_sparse[b, :, q0:q1], extras.v_sparse_idx[b, :, q0:q1] = vals, idx
            codes, scale, zero = quantize_pack_reference(leaving, v_bits, G, "token", extras.v_levels, exclude)
            v_codes[b, :, q0:q1] = codes
            v_scale[b, :, q0:q1] = scale
            v_zero[b, :, q0:q1] = zero
        first_kept = max(L, end - R)
        u = torch.arange(first_kept, end, device=key.device)
        v_res[b][:, u % R] = new_v[:, u - L]
    if counts is None:
        lengths += n
    else:
        lengths += counts.to(lengths.dtype)


def _append_row_ott(layer: LayerTensors, params: QuantParams, pool, b: int, L: int, new_k, new_v) -> None:
    """append_reference for row b under OTT's flush policy (schedule.py), G-token groups at a time."""
    k_codes, k_scale, k_zero, k_res, v_codes, v_scale, v_zero, v_res, _ = layer.kivi
    k_bits, v_bits, G, R = params[:4]
    extras = layer.extras
    W = k_res.shape[2]
    c = new_k.shape[1]
    end = L + c
    q0, q1 = quantized_count_int(L, R, G, OTT)[0], quantized_count_int(end, R, G, OTT)[0]
    if pool is not None:
        _pool_sinks(pool, b, L, end, new_k, new_v)
    if q1 > q0:
        u = torch.arange(q0, q1, device=new_k.device)
        old = (u < L)[None, :, None]
        ring, fresh = u.clamp(max=max(L - 1, 0)) % W, (u - L).clamp(min=0, max=c - 1)
        keys = torch.where(old, k_res[b][:, ring], new_k[:, fresh])
        values = torch.where(old, v_res[b][:, ring], new_v[:, fresh])
        exclude = None
        if pool is not None:
            pooled = _pool_flush(pool, b, q0, q1, keys, values, G)
            exclude = pooled[:, :, None].expand(keys.shape)
        codes, scale, zero = quantize_pack_reference(keys, k_bits, G, "channel", extras.k_levels, exclude)
        k_codes[b, :, q0:q1] = codes
        k_scale[b, :, q0 // G : q1 // G] = scale
        k_zero[b, :, q0 // G : q1 // G] = zero
        codes, scale, zero = quantize_pack_reference(values, v_bits, G, "token", extras.v_levels)
        v_codes[b, :, q0:q1] = codes
        v_scale[b, :, q0:q1] = scale
        v_zero[b, :, q0:q1] = zero
    u = torch.arange(max(L, end - W), end, device=new_k.device)
    k_res[b][:, u % W] = new_k[:, u - L]
    v_res[b][:, u % W] = new_v[:, u - L]


def _pool_sinks(pool, b, L, end, new_k, new_v) -> None:
    pool_k, pool_v, pool_pos, sink, _ = pool
    for s in range(L, min(end, sink)):
        pool_k[b, :, s] = new_k[:, s - L]
        pool_v[b, :, s] = new_v[:, s - L]
        pool_pos[b, :, s] = s


def _pool_flush(pool, b, nqk, nqk_end, keys, values, R):
    """OTT steps (pool.py) over the windows [nqk, nqk_end) of row b; returns which tokens are pooled
    [H, nqk_end - nqk] (they stay out of the quantization statistics)."""
    pool_k, pool_v, pool_pos, sink, N = pool
    pooled = (torch.arange(nqk, nqk_end, device=keys.device) < sink)[None, :].repeat(keys.shape[0], 1)
    if N > 0:
        a, z = sink, sink + N
        for w0 in range(0, nqk_end - nqk, R):
            u = torch.arange(nqk + w0, nqk + w0 + R, device=keys.device)
            state = ott_step(
                pool_k[b : b + 1, :, a:z], pool_v[b : b + 1, :, a:z], pool_pos[b : b + 1, :, a:z],
                pool_k[b : b + 1, :, z:], pool_v[b : b + 1, :, z:], pool_pos[b : b + 1, :, z:],
                keys[None, :, w0 : w0 + R], values[None, :, w0 : w0 + R], u[None], (u >= sink)[None],
                torch.ones(1, dtype=torch.bool, device=keys.device),
            )
            pool_k[b : b + 1, :, a:z], pool_v[b : b + 1, :, a:z], pool_pos[b : b + 1, :, a:z] = state[:3]
            pool_k[b : b + 1, :, z:], pool_v[b : b + 1, :, z:], pool_pos[b : b + 1, :, z:] = state[3:6]
            pooled[:, w0 : w0 + R] |= state[6][0]
    return pooled


def materialize_block(layer: LayerTensors, start: int, stop: int, params: QuantParams):
    """fp32 keys and values of rows [start, stop), saturated to the cache dtype; keys in stored form
    (pre-RoPE when stored so). start must be a multiple of group_size."""
    k_codes, k_scale, k_zero, k_res, v_codes, v_scale, v_zero, v_res, lengths = layer.kivi
    k_bits, v_bits, group_size, residual_length = params[:4]
    extras = layer.extras
    R, G, D = residual_length, group_size, k_res.shape[-1]
    t = torch.arange(start, stop, device=k_codes.device)
    nqk, nqv = quantized_counts(lengths, R, G, params.flush_policy)
    g0, g1 = start // G, -(-stop // G)
    k_s = expand_groups(k_scale[:, :, g0:g1], G, "channel", D)[:, :, : stop - start]
    k_z = expand_groups(k_zero[:, :, g0:g1], G, "channel", D)[:, :, : stop - start]
    v_s = expand_groups(v_scale[:, :, start:stop], G, "token", D)
    v_z = expand_groups(v_zero[:, :, start:stop], G, "token", D)
    k_q = saturate(dequantize_float(code_values(unpack(k_codes[:, :, start:stop], k_bits), extras.k_levels),
                                    k_s, k_z), k_res.dtype)
    v_q = saturate(dequantize_float(code_values(unpack(v_codes[:, :, start:stop], v_bits), extras.v_levels),
                                    v_s, v_z), v_res.dtype)
    if extras.sparse:
        nk = key_outliers_per_window(extras.k_sparse, k_codes.shape[2], R)
        k_q = apply_key_outliers(k_q, start, extras.k_sparse, extras.k_sparse_idx, nk, R)
        v_q = apply_value_outliers(v_q, extras.v_sparse[:, :, start:stop], extras.v_sparse_idx[:, :, start:stop])
    slot = t % k_res.shape[2]
    k_quantized = (t[None, :] < nqk[:, None])[:, None, :, None]
    v_quantized = (t[None, :] < nqv[:, None])[:, None, :, None]
    keys = torch.where(k_quantized, k_q, k_res[:, :, slot].float())
    values = torch.where(v_quantized, v_q, v_res[:, :, slot].float())
    return keys, values


def _quantized_key_scores(qf, k_codes, k_scale, k_zero, start, stop, bits, G):
    """Scores of qf [B, H, rows, D] on keys [start, stop) unmaterialized: q.(c*s + z) = (q*s).c + q.z."""
    B, H, rows, D = qf.shape
    T = stop - start
    n_groups = -(-T // G)
    c = unpack_float(k_codes[:, :, start:stop], bits)
    if T % G:
        c = F.pad(c, (0, 0, 0, n_groups * G - T))
    c = c.view(B, H, n_groups, G, D)
    s = k_scale[:, :, start // G : start // G + n_groups].float()  # [B, H, groups, D]
    z = k_zero[:, :, start // G : start // G + n_groups].float()
    scaled_q = qf[:, :, None] * s[:, :, :, None, :]  # [B, H, groups, rows, D]
    scores = scaled_q @ c.transpose(-1, -2) + (qf @ z.transpose(-1, -2)).transpose(2, 3)[..., None]
    return scores.permute(0, 1, 3, 2, 4).reshape(B, H, rows, n_groups * G)[..., :T]


def _quantized_value_sum(p, v_codes, v_scale, v_zero, start, stop, bits, G):
    """p [B, H, rows, T] times values [start, stop) unmaterialized: p.(c*s + z) = (p*s).c + p.z."""
    B, H, rows, T = p.shape
    s = v_scale[:, :, start:stop].float()  # [B, H, T, groups]
    z = v_zero[:, :, start:stop].float()
    n_groups = s.shape[-1]
    c = unpack_float(v_codes[:, :, start:stop], bits)
    D = c.shape[-1]
    c = c.view(B, H, T, n_groups, D // n_groups).permute(0, 1, 3, 2, 4)  # [B, H, groups, T, Gv]
    scaled_p = (p[..., None] * s[:, :, None]).permute(0, 1, 4, 2, 3)  # [B, H, groups, rows, T]
    out = (scaled_p @ c).permute(0, 1, 3, 2, 4) + (p @ z)[..., None]  # [B, H, rows, groups, Gv]
    return out.reshape(B, H, rows, D)


def _online_softmax_step(scores, m, denom):
    """One online-softmax block: (p, correction, new max, new denominator); all -inf rows add nothing."""
    m_new = torch.maximum(m, scores.amax(dim=-1))
    m_safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
    p = torch.exp(scores - m_safe[..., None])
    correction = torch.exp(m - m_safe)
    return p, correction, m_new, denom * correction + p.sum(dim=-1)


def attend_reference(query, layer: LayerTensors, counts, params: QuantParams, scale: float) -> torch.Tensor:
    """Causal softmax attention of query [B, Hq, q, D] over each sequence's cache, one online softmax;
    query i of row b sits at lengths[b] - counts[b] + i, rows i >= counts[b] return zeros. Plain KIVI
    works in the packed domain, fp32 and unsaturated (an fp16 group may pass 65504 by < scale/2, finite in
    fp32); extras dequantize and saturate each block; the output is saturated to the query dtype."""
    k_codes, k_scale, k_zero, k_res, v_codes, v_scale, v_zero, v_res, lengths = layer.kivi
    k_bits, v_bits, G, R = params[:4]
    pool, extras = layer.pool, layer.extras
    B, Hq, q, D = query.shape
    H = k_codes.shape[1]
    groups = Hq // H
    counts = torch.full_like(lengths, q) if counts is None else counts.to(lengths.dtype)
    # Row r = g*q + i is query i of head h*groups + g.
    qf = query.float().reshape(B, H, groups * q, D) * scale
    i = torch.arange(q, device=query.device).repeat(groups)
    pos = (lengths - counts)[:, None] + i[None, :]
    valid_row = i[None, :] < counts[:, None]
    nqk, nqv = quantized_counts(lengths, R, G, params.flush_policy)
    W = k_res.shape[2]
    tail = int(torch.minimum(nqk, nqv).min()) if B else 0  # residual tokens start here or later

    m = torch.full((B, H, groups * q), float("-inf"), device=query.device)
    denom = torch.zeros_like(m)
    acc = torch.zeros(B, H, groups * q, D, device=query.device)
    max_len = int(lengths.max()) if B else 0
    for start in range(0, max_len, ATTEND_BLOCK_TOKENS):
        stop = min(start + ATTEND_BLOCK_TOKENS, max_len)
        t = torch.arange(start, stop, device=query.device)
        visible = ((t[None, None, :] <= pos[:, :, None]) & valid_row[:, :, None])[:, None]
        if pool is not None:
            visible = visible & ~pooled_mask(pool[2], t)[:, :, None, :]
        if extras.active:
            keys, values = materialize_block(layer, start, stop, params)
            if extras.rope_inv_freq is not None:
                keys = rope_at(keys, t, extras.rope_inv_freq)
            p, correction, m, denom = _online_softmax_step(
                (qf @ keys.transpose(-1, -2)).masked_fill(~visible, float("-inf")), m, denom)
            acc = acc * correction[..., None] + p @ values
            continue
        scores = _quantized_key_scores(qf, k_codes, k_scale, k_zero, start, stop, k_bits, G)
        a = max(start, tail)
        if a < stop:
            t_tail = torch.arange(a, stop, device=query.device)
            from_k_res = (t_tail[None, :] >= nqk[:, None])[:, None, None, :]
            exact = qf @ k_res[:, :, t_tail % W].float().transpose(-1, -2)
            scores[..., a - start :] = torch.where(from_k_res, exact, scores[..., a - start :])
        p, correction, m, denom = _online_softmax_step(scores.masked_fill(~visible, float("-inf")), m, denom)
        if a < stop:
            from_v_res = (t_tail[None, :] >= nqv[:, None])[:, None, None, :]
            p_tail = p[..., a - start :]
            p_exact = torch.where(from_v_res, p_tail, torch.zeros_like(p_tail))
            p = torch.cat([p[..., : a - start], p_tail - p_exact], dim=-1)
            pv = _quantized_value_sum(p, v_codes, v_scale, v_zero, start, stop, v_bits, G)
            pv = pv + p_exact @ v_res[:, :, t_tail % W].float()
        else:
            pv = _quantized_value_sum(p, v_codes, v_scale, v_zero, start, stop, v_bits, G)
        acc = acc * correction[..., None] + pv
    if pool is not None:
        pool_k, pool_v, pool_pos = pool
        scores, visible = pool_attention_scores(qf, pool_k, pool_pos, pos, valid_row, extras.rope_inv_freq)
        p, correction, m, denom = _online_softmax_step(scores.masked_fill(~visible, float("-inf")), m, denom)
        acc = acc * correction[..., None] + p @ pool_v.float()
    out = acc / denom.clamp(min=torch.finfo(torch.float32).tiny)[..., None]
    out = torch.where(denom[..., None] > 0, out, torch.zeros_like(out))
    return saturate(out, query.dtype).reshape(B, Hq, q, D).to(query.dtype)




def paged_append_reference(layer: LayerTensors, key, value, counts, params: QuantParams, pages: Paging) -> None:
    """append_reference on a paged layer; row b must already hold the pages paged_layout.pages_needed
    counts. Writes back only the pages from the first leaving value to the last flushed key."""
    B, _, n, _ = key.shape
    R, PS = params.residual_length, pages.page_size
    check_capacity(layer.lengths, counts, n, pages.capacity)
    counts_list = [n] * B if counts is None else counts.tolist()
    looped = range(B)
    if n == 1 and params.flush_policy != OTT and params.pool_args(layer) is None and not layer.extras.active:
        looped = _append_tokens_in_windows(layer, key, value, counts_list, params, pages)
    for b in looped:
        c = counts_list[b]
        if c == 0:
            continue
        L = int(layer.lengths[b])
        table = pages.block_table[b:b + 1]
        row = layer._replace(k_res=layer.k_res[b:b + 1], v_res=layer.v_res[b:b + 1], lengths=layer.lengths[b:b + 1])
        view = static_view(row, table)
        append_reference(view, key[b:b + 1], value[b:b + 1], None if counts is None else counts[b:b + 1], params)
        first, stop = max(L - R, 0) // PS, -(-((L + c) // R * R) // PS)
        ids = table[0, first:stop].long()
        if len(ids) == 0:
            continue
        for name in PAGED_TENSORS:
            pool, rows = getattr(layer, name), getattr(view, name)
            per_page = pool.shape[2]
            written = rows[0, :, first * per_page:stop * per_page]
            pool[ids] = written.reshape(pool.shape[1], len(ids), per_page, *pool.shape[3:]).transpose(0, 1)


def _append_tokens_in_windows(layer: LayerTensors, key, value, counts_list, params: QuantParams,
                              pages: Paging) -> list[int]:
    """One token per row, batched for the rows whose keys do not flush, with append_reference's ops on
    the same elements (same bits); returns the rows left to the loop."""
    R, G, PS = params.residual_length, params.group_size, pages.page_size
    lengths = layer.lengths.tolist()
    flush = [b for b, c in enumerate(counts_list) if c and (lengths[b] + 1) % R == 0]
    rows = [b for b, c in enumerate(counts_list) if c and (lengths[b] + 1) % R]
    if not rows:
        return flush
    b = torch.tensor(rows, device=key.device)
    L = layer.lengths[b]
    slot = L % R  # the key's slot, the new value's, and the leaving value's (L - R)
    layer.k_res[b, :, slot] = key[b, :, 0]
    leaving = (L >= R).nonzero()[:, 0]
    if len(leaving):
        lb, u = b[leaving], L[leaving] - R
        codes, scale, zero = quantize_pack_reference(layer.v_res[lb, :, slot[leaving]][:, :, None], params.v_bits, G,
                                                     "token")
        page, at = pages.block_table[lb, u // PS].long(), u % PS
        layer.v_codes[page, :, at], layer.v_scale[page, :, at], layer.v_zero[page, :, at] = (
            codes[:, :, 0], scale[:, :, 0], zero[:, :, 0])
    layer.v_res[b, :, slot] = value[b, :, 0]
    layer.lengths[b] += 1
    return flush


def paged_attend_reference(query, layer: LayerTensors, counts, params: QuantParams, scale: float,
                           pages: Paging) -> torch.Tensor:
    return attend_reference(query, static_view(layer, pages.block_table), counts, params, scale)


