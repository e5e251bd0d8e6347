"""The exact token pool for sink and OTT outlier tokens (docs/cache.md, "Sink and outlier tokens"),
as static-shape tensor code without host syncs. Slots [0, sink) hold positions 0..sink-1, then N
outlier slots ordered by key magnitude, then the spill slots, filled in order; pos -1 is empty."""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .rope import rope_at



def key_magnitude(k: Tensor) -> Tensor:
    return k.float().abs().sum(-1)


def pooled_mask(pool_pos: Tensor, t: Tensor) -> Tensor:
    """[B, H, T] bool: token t[j] of head h of row b is pooled. pool_pos [B, H, P], t [T]."""
    if pool_pos.shape[-1] == 0:
        return torch.zeros((*pool_pos.shape[:2], t.shape[0]), dtype=torch.bool, device=t.device)
    return (pool_pos[:, :, :, None] == t[None, None, None, :]).any(dim=2)


def pooled_mask_dense(pool_pos: Tensor, S: int) -> Tensor:
    """pooled_mask(pool_pos, arange(S)) by one scatter: O(P + S) instead of O(P * S)."""
    B, H, P = pool_pos.shape
    idx = torch.where(pool_pos >= 0, pool_pos, S).clamp(max=S)
    flags = torch.zeros((B, H, S + 1), dtype=torch.int32, device=pool_pos.device)
    return flags.scatter(2, idx, 1)[..., :S] > 0


def _pick(src: Tensor, onehot: Tensor) -> tuple[Tensor, Tensor]:
    """onehot [B, H, C, K], at most one True per column: (source row [B, H, K] of each column, found)."""
    C = onehot.shape[2]
    i = torch.arange(C, device=onehot.device)[None, None, :, None]
    return (onehot.to(torch.int64) * i).sum(dim=2), onehot.any(dim=2)


def _gather_rows(x: Tensor, idx: Tensor) -> Tensor:
    return torch.gather(x, 2, idx[..., None].expand(*idx.shape, x.shape[-1]))


def ott_step(act_k: Tensor, act_v: Tensor, act_pos: Tensor, spill_k: Tensor, spill_v: Tensor, spill_pos: Tensor,
             win_k: Tensor, win_v: Tensor, win_pos: Tensor, win_valid: Tensor, proceed: Tensor):
    """One OTT selection step for a batch. act_*: outlier pool [B, H, N(, D)]; spill_*: [B, H, SP(, D)];
    win_k/win_v [B, H, R, D] the window's exact keys/values at win_pos [B, R]; win_valid [B, R]: may
    become outliers (not sinks); proceed [B]: rows quantizing now. Returns the new pools and entrants
    [B, H, R], the window tokens that joined the pool."""
    B, H, N = act_pos.shape
    SP = spill_pos.shape[2]
    R = win_pos.shape[1]
    device = act_pos.device
    cand_k = torch.cat([act_k, win_k], dim=2)
    cand_v = torch.cat([act_v, win_v], dim=2)
    cand_pos = torch.cat([act_pos, win_pos[:, None, :].expand(B, H, R)], dim=2)
    valid = torch.cat([act_pos >= 0, win_valid[:, None, :].expand(B, H, R)], dim=2)
    score = torch.where(valid, key_magnitude(cand_k), float("inf"))
    C = N + R
    idx = torch.arange(C, device=device)
    # rank: candidates before it in (score, index) order; invalid ones (inf) last.
    before = (score[:, :, None, :] < score[:, :, :, None]) | (
        (score[:, :, None, :] == score[:, :, :, None]) & (idx[None, :] < idx[:, None])[None, None])
    rank = before.sum(dim=-1)
    selected = valid & (rank < N)

    slot = torch.arange(N, device=device)
    src, has = _pick(cand_pos, selected[..., None] & (rank[..., None] == slot))
    new_act_k = torch.where(has[..., None], _gather_rows(cand_k, src), torch.zeros((), dtype=act_k.dtype, device=device))
    new_act_v = torch.where(has[..., None], _gather_rows(cand_v, src), torch.zeros((), dtype=act_v.dtype, device=device))
    new_act_pos = torch.where(has, torch.gather(cand_pos, 2, src), -1)

    evicted = (act_pos >= 0) & ~selected[:, :, :N]
    n_evicted = evicted.sum(dim=-1)
    spill_count = (spill_pos >= 0).sum(dim=-1)
    go = proceed[:, None] & (n_evicted <= SP - spill_count)
    if SP > 0 and N > 0:
        dest = spill_count[..., None] + torch.cumsum(evicted.to(torch.int64), dim=-1) - 1
        s = torch.arange(SP, device=device)
        src_s, has_s = _pick(act_pos, evicted[..., None] & (dest[..., None] == s))
        has_s = has_s & go[..., None]
        spill_k = torch.where(has_s[..., None], _gather_rows(act_k, src_s), spill_k)
        spill_v = torch.where(has_s[..., None], _gather_rows(act_v, src_s), spill_v)
        spill_pos = torch.where(has_s, torch.gather(act_pos, 2, src_s), spill_pos)
    g = go[..., None]
    act_k = torch.where(g[..., None], new_act_k, act_k)
    act_v = torch.where(g[..., None], new_act_v, act_v)
    act_pos = torch.where(g, new_act_pos, act_pos)
    entrants = selected[:, :, N:] & g
    return act_k, act_v, act_pos, spill_k, spill_v, spill_pos, entrants


def pool_attention_scores(qf: Tensor, pool_k: Tensor, pool_pos: Tensor, pos: Tensor, valid_row: Tensor,
                          rope_inv_freq: Optional[Tensor] = None):
    """Scores [B, H, rows, P] of scaled fp32 queries against the pool, and which are visible (filled,
    causal, real rows). rope_inv_freq: the pool holds pre-RoPE keys, rotated here."""
    keys = pool_k.float()
    if rope_inv_freq is not None:
        keys = rope_at(keys, pool_pos, rope_inv_freq)
    scores = qf @ keys.transpose(-1, -2)
    pp = pool_pos[:, :, None, :]
    visible = (pp >= 0) & (pp <= pos[:, None, :, None]) & valid_row[:, None, :, None]
    return scores, visible
