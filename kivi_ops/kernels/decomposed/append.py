"""Static-shape, data-independent cache append: what torch.compile, torch.export, ONNX and
ExecuTorch trace (the reference in reference.py loops over sequences and reads lengths on the host).

The function computes with tensor ops whose shapes depend only on the buffer and input shapes
(B, H, n, D, S, R, G, bits), never on the lengths or counts: indices are computed from tensors and
used with gather / advanced indexing / index_put_, choices are torch.where. No host sync, no
data-dependent shapes, no Python branch on a tensor value. Layout and policy: layout.py.

append_decomposed writes exactly what append_reference writes, bit for bit, on every slot of every
buffer (slots the policy does not touch are rewritten with their old contents). Capacity is not
checked (that needs a host sync): the caller must not append past max_seq_len. If it does,
nothing raises; rows are written modulo the buffer sizes and the cache is garbage.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ...options.extras import key_outliers_per_window, select_key_outliers, select_outliers
from ...layout import LayerTensors, QuantParams
from ...paged_layout import Paging
from ..reference.packing import quantize_pack_reference
from ...options.pool import ott_step
from ...options.schedule import OTT


def mod_nonneg(x: Tensor, m: int, bound: int) -> Tensor:
    """x mod m for integer x >= -bound, computed on a non-negative operand: ExecuTorch's portable
    remainder kernel does not follow Python's sign convention for negative operands."""
    return torch.remainder(x + m * (bound // m + 2), m)


def _bh_index(B: int, H: int, device) -> tuple[Tensor, Tensor]:
    """Broadcastable batch [B, 1, 1] and head [1, H, 1] indices for buf[b, h, rows[:, None, :]]."""
    return (torch.arange(B, device=device)[:, None, None], torch.arange(H, device=device)[None, :, None])


def _write_rows(buf: Tensor, bi: Tensor, hi: Tensor, rows: Tensor, new: Tensor, valid: Tensor,
                pages: Optional[Paging] = None) -> None:
    """buf[b, h, rows[b, j]] = new[b, h, j] where valid[b, j], else rewritten unchanged.

    rows [B, W] must be distinct within each row b (no scatter conflicts), new [B, H, W, X].
    pages: buf is a page pool [N + 1, H, X_page, ...] (paged_layout.py): row r of sequence b is row
    r % X_page of page block_table[b, r // X_page]; writes that are not valid go to the scratch
    page N instead (the row may own no page there, and the page another row owns)."""
    if pages is not None:
        per_page = buf.shape[2]
        page = pages.block_table.long().gather(1, torch.div(rows, per_page, rounding_mode="floor"))
        page = torch.where(valid, page.clamp(0, buf.shape[0] - 2), buf.shape[0] - 1)
        buf.index_put_((page[:, None, :], hi, torch.remainder(rows, per_page)[:, None, :]), new.to(buf.dtype))
        return
    r = rows[:, None, :]
    old = buf[bi, hi, r]
    # ONNX Runtime has no int16 Where (the sparse store's indices): choose in int32, store back.
    wide = torch.int32 if buf.dtype == torch.int16 else buf.dtype
    buf.index_put_((bi, hi, r), torch.where(valid[:, None, :, None], new.to(wide), old.to(wide)).to(buf.dtype))


def _take_tokens(x: Tensor, bi: Tensor, hi: Tensor, idx: Tensor) -> Tensor:
    """x[b, h, idx[b, j]] -> [B, H, W, D] (idx already clamped in range)."""
    return x[bi, hi, idx[:, None, :]]


def _branch(pred: Tensor, true_fn, false_fn):
    """torch.cond(pred, true_fn, false_fn, ()) when traced; eagerly a Python `if` (an eager
    torch.cond traces its branches with symbolic shapes, which these reshapes do not survive)."""
    if torch.compiler.is_compiling():
        return torch.cond(pred, true_fn, false_fn, ())
    return true_fn() if pred.item() else false_fn()


def _ott_steps(pool_parts, sink: int, n_out: int, stream: Tensor, v_stream: Tensor, u: Tensor, flushed: Tensor,
               unit: int):
    """OTT steps (pool.py), window by window, over the exact keys / values [B, H, windows * unit,
    D] at positions u [B, windows * unit] about to be quantized (unit: the policy's key flush
    unit); windows at or past flushed [B] tokens change nothing. Returns (entrants [B, H,
    windows * unit], the new (pool_k, pool_v, pool_pos))."""
    pk, pv, ppos = pool_parts
    a, z = sink, sink + n_out
    state = (pk[:, :, a:z], pv[:, :, a:z], ppos[:, :, a:z], pk[:, :, z:], pv[:, :, z:], ppos[:, :, z:])
    entrants = []
    for w in range(u.shape[1] // unit):
        win = slice(w * unit, (w + 1) * unit)
        *state, entered = ott_step(*state, stream[:, :, win], v_stream[:, :, win], u[:, win], u[:, win] >= sink,
                                   w * unit < flushed)
        entrants.append(entered)
    return torch.cat(entrants, dim=2), (torch.cat([pk[:, :, :a], state[0], state[3]], 2),
                                        torch.cat([pv[:, :, :a], state[1], state[4]], 2),
                                        torch.cat([ppos[:, :, :a], state[2], state[5]], 2))


def _flush_ott_groups(layer: LayerTensors, key: Tensor, value: Tensor, params: QuantParams, bi: Tensor, hi: Tensor,
                      L: Tensor, q0: Tensor, q1: Tensor, groups: int, last_new, pool):
    """OTT's flush policy (schedule.py): quantize the first `groups` G-token groups of the stream
    from token q0 on (ring slot u % W for u < L, else the appended token), keys per channel and
    values per token, and write those below q1 (the others rewrite old rows; distinct since
    groups * G <= S). pool: as in _flush_key_windows; returns its new parts (None without)."""
    k_codes, k_scale, k_zero, k_res, v_codes, v_scale, v_zero, v_res, _ = layer.kivi
    k_bits, v_bits, G, _ = params[:4]
    extras = layer.extras
    B, H, _, D = key.shape
    S, RR = k_codes.shape[2], k_res.shape[2]
    device = key.device
    T = groups * G
    flushed = (q1 - q0)[:, None]
    j = torch.arange(T, device=device)
    u = q0[:, None] + j[None, :]  # [B, T]
    old = (u < L[:, None])[:, None, :, None]
    ring = torch.remainder(u, RR)
    fresh = (u - L[:, None]).clamp(0, last_new)
    keys = torch.where(old, _take_tokens(k_res, bi, hi, ring), _take_tokens(key, bi, hi, fresh))
    values = torch.where(old, _take_tokens(v_res, bi, hi, ring), _take_tokens(value, bi, hi, fresh))
    exclude = parts = None
    if pool is not None:
        pk, pv, ppos, sink, n_out = pool
        pooled = (u < sink)[:, None, :].expand(B, H, T)
        parts = (pk, pv, ppos)
        if n_out > 0:
            entered, parts = _ott_steps(parts, sink, n_out, keys, values, u, flushed[:, 0], G)
            pooled = pooled | entered
        exclude = pooled[..., None].expand(B, H, T, D)
    valid = j[None, :] < flushed
    rows = torch.remainder(u, S)
    codes, scale, zero = quantize_pack_reference(keys, k_bits, G, "channel", extras.k_levels, exclude)
    _write_rows(k_codes, bi, hi, rows, codes, valid)
    gj = torch.arange(groups, device=device)
    grows = (torch.div(q0, G, rounding_mode="floor")[:, None] + gj[None, :]) % k_scale.shape[2]
    gvalid = gj[None, :] * G < flushed
    _write_rows(k_scale, bi, hi, grows, scale, gvalid)
    _write_rows(k_zero, bi, hi, grows, zero, gvalid)
    codes, scale, zero = quantize_pack_reference(values, v_bits, G, "token", extras.v_levels)
    _write_rows(v_codes, bi, hi, rows, codes, valid)
    _write_rows(v_scale, bi, hi, rows, scale, valid)
    _write_rows(v_zero, bi, hi, rows, zero, valid)
    return parts


def _append_ott(layer: LayerTensors, key: Tensor, value: Tensor, params: QuantParams, bi, hi, L, end, n, symbolic,
                last_new, pool, flush_under_cond: bool):
    """append_decomposed's flushes and residual writes under OTT's flush policy (schedule.py);
    returns the pool's new parts (None without a pool)."""
    k_codes, _, _, k_res, _, _, _, v_res, _ = layer.kivi
    _, _, G, R = params[:4]
    S, RR = k_codes.shape[2], k_res.shape[2]
    device = key.device
    parts = None if pool is None else pool[:3]
    q0 = torch.div((L - R).clamp(min=0), G, rounding_mode="floor") * G
    q1 = torch.div((end - R).clamp(min=0), G, rounding_mode="floor") * G
    # Most groups n new tokens can complete: the residual holds at most R + G - 1 tokens.
    groups = S // G if symbolic else min((G - 1 + n) // G, S // G)
    if groups > 0 and n > 0:
        args = (layer, key, value, params, bi, hi, L, q0, q1, groups, last_new, pool)
        if flush_under_cond and (pool is None or pool[4] == 0) and not torch.is_grad_enabled():
            # as in append_decomposed: a decode step completes a group once every G steps
            def flush():
                _flush_ott_groups(*args)
                return L.new_zeros(())

            _branch((q1 > q0).any(), flush, lambda: L.new_zeros(()))
        else:
            new_parts = _flush_ott_groups(*args)
            parts = parts if new_parts is None else new_parts
    # Residuals, after every read of the old ones: new token u goes to slot u % W if it is among
    # the last W (the residual never holds more than R + G - 1 <= W tokens).
    if n > 0 and not symbolic and n <= RR:
        u = L[:, None] + torch.arange(n, device=device)[None, :]  # [B, n]: distinct slots mod RR
        take = (u < end[:, None]) & (u >= end[:, None] - RR)
        _write_rows(k_res, bi, hi, torch.remainder(u, RR), key, take)
        _write_rows(v_res, bi, hi, torch.remainder(u, RR), value, take)
    elif n > 0:  # rebuilt whole: slot s holds the newest token u = s (mod RR) below end if it is new
        s = torch.arange(RR, device=device)
        u = end[:, None] - RR + mod_nonneg(s[None, :] - end[:, None], RR, S)
        take = (u >= L[:, None])[:, None, :, None]
        idx = (u - L[:, None]).clamp(0, last_new)
        k_res.copy_(torch.where(take, _take_tokens(key, bi, hi, idx), k_res))
        v_res.copy_(torch.where(take, _take_tokens(value, bi, hi, idx), v_res))
    return parts


def _flush_key_windows(layer: LayerTensors, key: Tensor, value: Tensor, params: QuantParams, bi: Tensor, hi: Tensor,
                       L: Tensor, nqk: Tensor, nqk_end: Tensor, windows: int, last_new, pool,
                       pages: Optional[Paging] = None):
    """Quantize per channel the first `windows` R-windows of the key stream from token nqk on (the
    residual window's tokens, then the new ones), and write those below nqk_end (the windows this
    append completes; the others rewrite old rows). pool: (pool_k, pool_v, pool_pos, sink,
    outliers) as updated so far, or None; returns its new (pool_k, pool_v, pool_pos) after the
    OTT steps (None without a pool). pages: the layer is paged (paged_layout.py)."""
    k_codes, k_scale, k_zero, k_res, _, _, _, v_res, _ = layer.kivi
    k_bits, _, G, R = params[:4]
    extras = layer.extras
    B, H, _, D = key.shape
    S, RR = _capacity(k_codes, pages), k_res.shape[2]
    n_scale_rows = k_scale.shape[2] if pages is None else S // G
    device = key.device
    W = windows * R
    flushed = (nqk_end - nqk)[:, None]
    j = torch.arange(W, device=device)
    u = nqk[:, None] + j[None, :]  # [B, W]
    from_res = u < L[:, None]
    old_part = k_res[:, :, j.clamp(max=RR - 1)]  # slot of u < L is u % R = j (nqk % R == 0)
    new_part = _take_tokens(key, bi, hi, (u - L[:, None]).clamp(0, last_new))
    stream = torch.where(from_res[:, None, :, None], old_part.expand(B, H, W, D), new_part)
    pooled = None
    if pool is not None:
        pk, pv, ppos, sink, n_out = pool
        pooled = (u < sink)[:, None, :].expand(B, H, W)
        if n_out > 0:
            v_old = v_res[:, :, j.clamp(max=RR - 1)]  # value slot of u < L is u % R = j too
            v_new = _take_tokens(value, bi, hi, (u - L[:, None]).clamp(0, last_new))
            v_stream = torch.where(from_res[:, None, :, None], v_old.expand(B, H, W, D), v_new)
            entered, (pk, pv, ppos) = _ott_steps(pool[:3], sink, n_out, stream, v_stream, u, flushed[:, 0], R)
            pooled = pooled | entered
    # Pooled tokens (sinks, new outliers) are exact in the pool: out of the statistics.
    exclude = None if pooled is None else pooled[..., None].expand(B, H, W, D)
    nk = key_outliers_per_window(extras.k_sparse, S, R) if extras.sparse else 0
    if nk:  # dense-and-sparse: per channel, the window's largest keys stay exact
        outliers, vals, idx = select_key_outliers(stream, nk, R, pooled)
        exclude = outliers if exclude is None else exclude | outliers
        oj = torch.arange(windows * nk, device=device)
        orows = (torch.div(nqk, R, rounding_mode="floor")[:, None] * nk + oj[None, :]) % extras.k_sparse.shape[2]
        ovalid = torch.div(oj, nk, rounding_mode="floor")[None, :] * R < flushed
        _write_rows(extras.k_sparse, bi, hi, orows, vals, ovalid)
        _write_rows(extras.k_sparse_idx, bi, hi, orows, idx, ovalid)
    codes, scale, zero = quantize_pack_reference(stream, k_bits, G, "channel", extras.k_levels, exclude)
    _write_rows(k_codes, bi, hi, u % S, codes, j[None, :] < flushed, pages)
    gj = torch.arange(W // G, device=device)
    grows = (torch.div(nqk, G, rounding_mode="floor")[:, None] + gj[None, :]) % n_scale_rows
    gvalid = gj[None, :] * G < flushed
    _write_rows(k_scale, bi, hi, grows, scale, gvalid, pages)
    _write_rows(k_zero, bi, hi, grows, zero, gvalid, pages)
    return None if pool is None else (pk, pv, ppos)


def _capacity(k_codes: Tensor, pages: Optional[Paging]) -> int:
    """Tokens a row can hold: S of the static layout, max_pages_per_seq * page_size when paged."""
    return k_codes.shape[2] if pages is None else pages.block_table.shape[1] * k_codes.shape[2]


def append_decomposed(layer: LayerTensors, key: Tensor, value: Tensor, counts, params: QuantParams, *,
                      flush_under_cond: bool = False, pages: Optional[Paging] = None) -> None:
    """append_reference without host syncs or data-dependent shapes (mutates the nine KIVI
    tensors, the pool's three when there is a pool, see pool.py, and the sparse outlier store
    when there is one, see extras.py).

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

    flush_under_cond (dispatch's "decomposed_cond", CPU compile): the key flush runs only when
    some row completes a window, under torch.cond (eagerly, a Python if). Writes are the same.

    pages: the layer is paged (paged_layout.py; its quantized buffers are page pools): the same
    computation, rows written through the block table (_write_rows), capacity S = M * PS. The
    sparse store is not paged (the paged layer refuses it).
    """
    k_codes, k_scale, k_zero, k_res, v_codes, v_scale, v_zero, v_res, lengths = layer.kivi
    k_bits, v_bits, G, R = params[:4]
    pool, extras = params.pool_args(layer), layer.extras
    # The cache stores new tokens in its own dtype (the reference's slice assignment casts too).
    key, value = key.to(k_res.dtype), value.to(v_res.dtype)
    B, H, n, D = key.shape
    S, RR = _capacity(k_codes, pages), k_res.shape[2]
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

    if params.flush_policy == OTT:
        parts = _append_ott(layer, key, value, params, bi, hi, L, end, n, symbolic, last_new,
                            None if pool is None else (pk, pv, ppos, sink, n_out), flush_under_cond)
        if pool is not None and pool_pos.shape[2] > 0:
            pool_k.copy_(parts[0])
            pool_v.copy_(parts[1])
            pool_pos.copy_(parts[2])
        lengths.add_(c)
        return

    # ---- keys: quantize the whole R-windows the append completes.
    nqk = torch.div(L, R, rounding_mode="floor") * R
    nqk_end = torch.div(end, R, rounding_mode="floor") * R
    # A symbolic n would make the window count symbolic, and shape reasoning would specialize on
    # whether it is 1; the traced program instead always quantizes the S // R windows it could
    # ever flush (about the cost of the materialized attention it runs anyway).
    windows = S // R if symbolic else min((R - 1 + n) // R, S // R)
    if windows > 0 and n > 0:
        args = (layer, key, value, params, bi, hi, L, nqk, nqk_end, windows, last_new,
                None if pool is None else (pk, pv, ppos, sink, n_out), pages)
        if flush_under_cond and (pool is None or n_out == 0) and not torch.is_grad_enabled():
            # A decode step completes a window once every R steps: under torch.cond (a host-side
            # `if` in Inductor's CPU code) the other R - 1 steps skip quantizing R tokens per head.
            # The OTT pool's updates are new tensors, which a branch cannot rebind: unbranched.
            # torch.cond traces buffer mutation only with grad off (no_grad, inference_mode:
            # every decode loop here); a graph traced with grad on takes the unbranched path.
            def flush():
                _flush_key_windows(*args)
                return L.new_zeros(())  # a branch must return a tensor

            _branch((nqk_end > nqk).any(), flush, lambda: L.new_zeros(()))
        elif pool is None:
            _flush_key_windows(*args)
        else:
            pk, pv, ppos = _flush_key_windows(*args)

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
        _write_rows(v_codes, bi, hi, rows, codes, valid, pages)
        _write_rows(v_scale, bi, hi, rows, scale, valid, pages)
        _write_rows(v_zero, bi, hi, rows, zero, valid, pages)

    # ---- residuals, after every read of the old ones above.
    if n > 0 and not symbolic and n <= R == RR:
        # Few new tokens (decode): write their slots only. Consecutive tokens, at most R of them,
        # have distinct slots mod R, so the rows never collide. Key slot of token u: u - nqk_end
        # if u >= nqk_end (else it was flushed); value slot u % R if u is among the last R.
        u = L[:, None] + torch.arange(n, device=device)[None, :]  # [B, n]
        real = u < end[:, None]
        _write_rows(k_res, bi, hi, mod_nonneg(u - nqk_end[:, None], R, S), key, real & (u >= nqk_end[:, None]))
        _write_rows(v_res, bi, hi, u % R, value, real & (u >= end[:, None] - R))
    elif n > 0:  # rebuilt whole (RR slots)
        s = torch.arange(RR, device=device)
        u = nqk_end[:, None] + s[None, :]  # keys: slot s holds token nqk_end + s
        take = (u >= L[:, None]) & (u < end[:, None])
        new = _take_tokens(key, bi, hi, (u - L[:, None]).clamp(0, last_new))
        k_res.copy_(torch.where(take[:, None, :, None], new, k_res))
        u = end[:, None] - R + mod_nonneg(s[None, :] - end[:, None], R, S)  # values: newest u = s mod R below end
        take = u >= L[:, None]
        new = _take_tokens(value, bi, hi, (u - L[:, None]).clamp(0, last_new))
        v_res.copy_(torch.where(take[:, None, :, None], new, v_res))

    if pool is not None and pool_pos.shape[2] > 0:
        pool_k.copy_(pk)
        pool_v.copy_(pv)
        pool_pos.copy_(ppos)
    lengths.add_(c)
