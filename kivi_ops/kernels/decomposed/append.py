"""Static-shape cache append that torch.compile, torch.export, ONNX and ExecuTorch trace: shapes depend
only on buffer and input shapes, never on lengths; no host sync, no branch on a tensor value. Writes
what append_reference writes, bit for bit. Capacity is not checked: appending past max_seq_len
silently wraps rows and corrupts the cache."""

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
    """x mod m for x >= -bound on a non-negative operand: ExecuTorch's remainder differs for negatives."""
    return torch.remainder(x + m * (bound // m + 2), m)


def _bh_index(B: int, H: int, device) -> tuple[Tensor, Tensor]:
    return (torch.arange(B, device=device)[:, None, None], torch.arange(H, device=device)[None, :, None])


def _write_rows(buf: Tensor, bi: Tensor, hi: Tensor, rows: Tensor, new: Tensor, valid: Tensor,
                pages: Optional[Paging] = None) -> None:
    """buf[b, h, rows[b, j]] = new[b, h, j] where valid[b, j]; rows [B, W] distinct per b (no scatter
    conflicts). Paged: invalid writes go to the scratch page N, since the row may own no page there."""
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
    return x[bi, hi, idx[:, None, :]]


def _branch(pred: Tensor, true_fn, false_fn):
    """torch.cond when traced; eagerly a Python `if` (eager torch.cond traces symbolic shapes these reshapes fail)."""
    if torch.compiler.is_compiling():
        return torch.cond(pred, true_fn, false_fn, ())
    return true_fn() if pred.item() else false_fn()


def _ott_steps(pool_parts, sink: int, n_out: int, stream: Tensor, v_stream: Tensor, u: Tensor, flushed: Tensor,
               unit: int):
    """OTT steps (pool.py) window by window over the tokens about to be quantized; returns (entrants,
    the new (pool_k, pool_v, pool_pos))."""
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
    """OTT's flush (schedule.py): quantize `groups` G-token groups from token q0, write those below q1."""
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
    k_codes, _, _, k_res, _, _, _, v_res, _ = layer.kivi
    _, _, G, R = params[:4]
    S, RR = k_codes.shape[2], k_res.shape[2]
    device = key.device
    parts = None if pool is None else pool[:3]
    q0 = torch.div((L - R).clamp(min=0), G, rounding_mode="floor") * G
    q1 = torch.div((end - R).clamp(min=0), G, rounding_mode="floor") * G
    groups = S // G if symbolic else min((G - 1 + n) // G, S // G)
    if groups > 0 and n > 0:
        args = (layer, key, value, params, bi, hi, L, q0, q1, groups, last_new, pool)
        if flush_under_cond and (pool is None or pool[4] == 0) and not torch.is_grad_enabled():
            def flush():
                _flush_ott_groups(*args)
                return L.new_zeros(())

            _branch((q1 > q0).any(), flush, lambda: L.new_zeros(()))
        else:
            new_parts = _flush_ott_groups(*args)
            parts = parts if new_parts is None else new_parts
    # Residuals, after every read of the old ones.
    if n > 0 and not symbolic and n <= RR:
        u = L[:, None] + torch.arange(n, device=device)[None, :]  # [B, n]: distinct slots mod RR
        take = (u < end[:, None]) & (u >= end[:, None] - RR)
        _write_rows(k_res, bi, hi, torch.remainder(u, RR), key, take)
        _write_rows(v_res, bi, hi, torch.remainder(u, RR), value, take)
    elif n > 0:
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
    """Quantize per channel `windows` R-windows of the key stream from token nqk, write those below
    nqk_end; returns the pool's new (pool_k, pool_v, pool_pos), None without a pool."""
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
    old_part = k_res[:, :, j.clamp(max=RR - 1)]
    new_part = _take_tokens(key, bi, hi, (u - L[:, None]).clamp(0, last_new))
    stream = torch.where(from_res[:, None, :, None], old_part.expand(B, H, W, D), new_part)
    pooled = None
    if pool is not None:
        pk, pv, ppos, sink, n_out = pool
        pooled = (u < sink)[:, None, :].expand(B, H, W)
        if n_out > 0:
            v_old = v_res[:, :, j.clamp(max=RR - 1)]
            v_new = _take_tokens(value, bi, hi, (u - L[:, None]).clamp(0, last_new))
            v_stream = torch.where(from_res[:, None, :, None], v_old.expand(B, H, W, D), v_new)
            entered, (pk, pv, ppos) = _ott_steps(pool[:3], sink, n_out, stream, v_stream, u, flushed[:, 0], R)
            pooled = pooled | entered
    exclude = None if pooled is None else pooled[..., None].expand(B, H, W, D)
    nk = key_outliers_per_window(extras.k_sparse, S, R) if extras.sparse else 0
    if nk:
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
    return k_codes.shape[2] if pages is None else pages.block_table.shape[1] * k_codes.shape[2]


def append_decomposed(layer: LayerTensors, key: Tensor, value: Tensor, counts, params: QuantParams, *,
                      flush_under_cond: bool = False, pages: Optional[Paging] = None) -> None:
    """append_reference without host syncs; key/value [B, H, n, D], row b's first counts[b] tokens real.
    flush_under_cond: the key flush runs under torch.cond only when some row completes a window."""
    k_codes, k_scale, k_zero, k_res, v_codes, v_scale, v_zero, v_res, lengths = layer.kivi
    k_bits, v_bits, G, R = params[:4]
    pool, extras = params.pool_args(layer), layer.extras
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
        # Exported n is bounded 1 <= n <= S: no symbolic min/max (ExecuTorch rejects them).
        last_new = n - 1
    else:
        last_new = max(n - 1, 0)

    if pool is not None:
        pool_k, pool_v, pool_pos, sink, n_out = pool
        pk, pv, ppos = pool_k, pool_v, pool_pos
        if sink > 0 and n > 0:
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

    nqk = torch.div(L, R, rounding_mode="floor") * R
    nqk_end = torch.div(end, R, rounding_mode="floor") * R
    # Symbolic n: flush all S // R windows, else shape reasoning specializes on the count.
    windows = S // R if symbolic else min((R - 1 + n) // R, S // R)
    if windows > 0 and n > 0:
        args = (layer, key, value, params, bi, hi, L, nqk, nqk_end, windows, last_new,
                None if pool is None else (pk, pv, ppos, sink, n_out), pages)
        if flush_under_cond and (pool is None or n_out == 0) and not torch.is_grad_enabled():
            # torch.cond traces buffer mutation only with grad off; pool updates cannot be rebound.
            def flush():
                _flush_key_windows(*args)
                return L.new_zeros(())

            _branch((nqk_end > nqk).any(), flush, lambda: L.new_zeros(()))
        elif pool is None:
            _flush_key_windows(*args)
        else:
            pk, pv, ppos = _flush_key_windows(*args)

    NV = n if symbolic else min(n, S)
    q0 = (L - R).clamp(min=0)
    q1 = (end - R).clamp(min=0)
    if NV > 0 and S > R:
        j = torch.arange(NV, device=device)
        u = q0[:, None] + j[None, :]  # [B, NV]
        from_win = u < L[:, None]
        win = _take_tokens(v_res, bi, hi, (u % R).clamp(max=RR - 1))
        new = _take_tokens(value, bi, hi, (u - L[:, None]).clamp(0, last_new))
        leaving = torch.where(from_win[:, None, :, None], win, new)
        valid = u < q1[:, None]
        rows = u % S
        exclude = None
        if extras.sparse:
            exclude, vals, idx = select_outliers(leaving, extras.v_sparse.shape[-1], dim=-1)
            _write_rows(extras.v_sparse, bi, hi, rows, vals, valid)
            _write_rows(extras.v_sparse_idx, bi, hi, rows, idx, valid)
        codes, scale, zero = quantize_pack_reference(leaving, v_bits, G, "token", extras.v_levels, exclude)
        _write_rows(v_codes, bi, hi, rows, codes, valid, pages)
        _write_rows(v_scale, bi, hi, rows, scale, valid, pages)
        _write_rows(v_zero, bi, hi, rows, zero, valid, pages)

    # Residuals, after every read of the old ones; at most R consecutive tokens never collide mod R.
    if n > 0 and not symbolic and n <= R == RR:
        u = L[:, None] + torch.arange(n, device=device)[None, :]  # [B, n]
        real = u < end[:, None]
        _write_rows(k_res, bi, hi, mod_nonneg(u - nqk_end[:, None], R, S), key, real & (u >= nqk_end[:, None]))
        _write_rows(v_res, bi, hi, u % R, value, real & (u >= end[:, None] - R))
    elif n > 0:
        s = torch.arange(RR, device=device)
        u = nqk_end[:, None] + s[None, :]
        take = (u >= L[:, None]) & (u < end[:, None])
        new = _take_tokens(key, bi, hi, (u - L[:, None]).clamp(0, last_new))
        k_res.copy_(torch.where(take[:, None, :, None], new, k_res))
        u = end[:, None] - R + mod_nonneg(s[None, :] - end[:, None], R, S)
        take = u >= L[:, None]
        new = _take_tokens(value, bi, hi, (u - L[:, None]).clamp(0, last_new))
        v_res.copy_(torch.where(take[:, None, :, None], new, v_res))

    if pool is not None and pool_pos.shape[2] > 0:
        pool_k.copy_(pk)
        pool_v.copy_(pv)
        pool_pos.copy_(ppos)
    lengths.add_(c)
