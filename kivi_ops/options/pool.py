"""The full-precision token pool: attention-sink tokens and OTT outlier tokens (one mechanism).

Per layer, three extra buffers (P = sink + outlier + spill slots, see KIVIConfig.layer_pool_size):
    pool_k    dtype [B, H, P, D]  exact keys of pooled tokens
    pool_v    dtype [B, H, P, D]  exact values of pooled tokens
    pool_pos  int64 [B, H, P]     position of the pooled token, -1 = empty slot
Slots [0, sink) hold positions 0..sink-1 (written as those tokens are appended); slots
[sink, sink + N) are OTT's outlier pool (N = outlier tokens of the layer), ordered by key
magnitude; slots [sink + N, P) are OTT's auxiliary ("spill") pool of tokens evicted from it,
filled in order.

A pooled token keeps its copies in the quantized part / residual windows, but attention masks
them out and uses the pool's exact key and value instead, in the same softmax. Key quantization
groups containing pooled tokens (sinks, new outliers) take their min/max without those rows (the
`exclude` of packing.quantize_pack_reference, as dense-and-sparse outliers do; the rows' own codes
saturate and are never read), so pooled tokens never enter the statistics, and the sparse store's
key outlier selection picks them last. Values are quantized per token, so a pooled token's value
affects only its own (masked) slot and is quantized unchanged.

OTT step (the OTT paper, Section 3.2 / Appendix E), run per (sequence, kv head) on each window of
keys the cache quantizes: R keys under KIVI's flush policy, one G-token group under OTT's own
(schedule.py; below, "R" is that window):
  candidates = the window's tokens (not sinks) + the tokens in the outlier pool;
  score = L1 norm of the exact key over head_dim (Appendix E's ||K_i||_1);
  the N smallest scores form the new outlier pool (ties: pool before window, then by position);
  pool tokens that lost are evicted to the spill pool, appended in their old pool order (they
  stay exact and masked: their groups were quantized without them, so they cannot
  "return to their original positions", which the paper also avoids with this pool);
  if the spill pool lacks room for this step's evictions, the step changes nothing (no new
  outliers; the window quantizes as plain KIVI, sinks aside): the paper's "when this pool is
  full, we stop identifying outlier tokens".
A window's tokens are all still exact when it is quantized (keys in the residual or the new
input, values in the R-token value window or the new input), so the pool copies exact K and V.
Prefill flushes several windows in one append; they are processed in order, so the pool after
any append equals the pool of the same tokens appended one at a time.

All helpers are static-shape tensor code without host syncs (used by the CPU reference and by
the decomposed / compiled / exported paths).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .rope import rope_at



def key_magnitude(k: Tensor) -> Tensor:
    """OTT outlier score: L1 norm of each key over head_dim, fp32. [..., D] -> [...]."""
    return k.float().abs().sum(-1)


def pooled_mask(pool_pos: Tensor, t: Tensor) -> Tensor:
    """[B, H, T] bool: token t[j] of head h of sequence b is in the pool. pool_pos [B, H, P], t [T]."""
    if pool_pos.shape[-1] == 0:
        return torch.zeros((*pool_pos.shape[:2], t.shape[0]), dtype=torch.bool, device=t.device)
    return (pool_pos[:, :, :, None] == t[None, None, None, :]).any(dim=2)


def pooled_mask_dense(pool_pos: Tensor, S: int) -> Tensor:
    """pooled_mask(pool_pos, arange(S)) by one scatter of the P positions: O(P + S) instead of
    O(P * S) (the decomposed attention's mask over the whole cache)."""
    B, H, P = pool_pos.shape
    idx = torch.where(pool_pos >= 0, pool_pos, S).clamp(max=S)  # empty slots hit a spare column
    flags = torch.zeros((B, H, S + 1), dtype=torch.int32, device=pool_pos.device)
    return flags.scatter(2, idx, 1)[..., :S] > 0


def _pick(src: Tensor, onehot: Tensor) -> tuple[Tensor, Tensor]:
    """onehot [B, H, C, K] (at most one True per column k): (index [B, H, K] of the source row of
    each column, whether there is one)."""
    C = onehot.shape[2]
    i = torch.arange(C, device=onehot.device)[None, None, :, None]
    return (onehot.to(torch.int64) * i).sum(dim=2), onehot.any(dim=2)


def _gather_rows(x: Tensor, idx: Tensor) -> Tensor:
    """x [B, H, C, D], idx [B, H, K] -> [B, H, K, D]."""
    return torch.gather(x, 2, idx[..., None].expand(*idx.shape, x.shape[-1]))


def ott_step(act_k: Tensor, act_v: Tensor, act_pos: Tensor, spill_k: Tensor, spill_v: Tensor, spill_pos: Tensor,
             win_k: Tensor, win_v: Tensor, win_pos: Tensor, win_valid: Tensor, proceed: Tensor):
    """One OTT quantization step (module doc) for a batch of sequences.

    act_*: outlier pool [B, H, N(, D)]; spill_*: spill pool [B, H, SP(, D)]; win_k/win_v
    [B, H, R, D] exact keys/values of the window being quantized, win_pos [B, R] their positions,
    win_valid [B, R] which of them may become outliers (not sinks); proceed [B]: sequences whose
    window is really quantized now (the others keep their pools).
    Returns the new (act_k, act_v, act_pos, spill_k, spill_v, spill_pos) and entrants [B, H, R]:
    window tokens that joined the pool (their key rows are to be replaced before quantizing)."""
    B, H, N = act_pos.shape
    SP = spill_pos.shape[2]
    R = win_pos.shape[1]
    device = act_pos.device
    cand_k = torch.cat([act_k, win_k], dim=2)  # [B, H, C, D], C = N + R
    cand_v = torch.cat([act_v, win_v], dim=2)
    cand_pos = torch.cat([act_pos, win_pos[:, None, :].expand(B, H, R)], dim=2)
    valid = torch.cat([act_pos >= 0, win_valid[:, None, :].expand(B, H, R)], dim=2)
    score = torch.where(valid, key_magnitude(cand_k), float("inf"))
    C = N + R
    idx = torch.arange(C, device=device)
    # rank of candidate i: candidates before it in (score, index) order; invalid ones (inf) last.
    before = (score[:, :, None, :] < score[:, :, :, None]) | (
        (score[:, :, None, :] == score[:, :, :, None]) & (idx[None, :] < idx[:, None])[None, None])
    rank = before.sum(dim=-1)  # [B, H, C]
    selected = valid & (rank < N)

    slot = torch.arange(N, device=device)
    src, has = _pick(cand_pos, selected[..., None] & (rank[..., None] == slot))
    new_act_k = torch.where(has[..., None], _gather_rows(cand_k, src), torch.zeros((), dtype=act_k.dtype, device=device))
    new_act_v = torch.where(has[..., None], _gather_rows(cand_v, src), torch.zeros((), dtype=act_v.dtype, device=device))
    new_act_pos = torch.where(has, torch.gather(cand_pos, 2, src), -1)

    evicted = (act_pos >= 0) & ~selected[:, :, :N]  # [B, H, N]
    n_evicted = evicted.sum(dim=-1)
    spill_count = (spill_pos >= 0).sum(dim=-1)
    go = proceed[:, None] & (n_evicted <= SP - spill_count)  # [B, H]
    if SP > 0 and N > 0:
        dest = spill_count[..., None] + torch.cumsum(evicted.to(torch.int64), dim=-1) - 1  # [B, H, N]
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
    """Scores [B, H, rows, P] of the scaled fp32 queries qf [B, H, rows, D] against the pool, and
    which are visible: a filled slot whose token is at or before the query (causal), real rows.
    rope_inv_freq: the pool holds pre-RoPE keys (KVQuant), rotated here to their positions."""
    keys = pool_k.float()
    if rope_inv_freq is not None:
        keys = rope_at(keys, pool_pos, rope_inv_freq)
    scores = qf @ keys.transpose(-1, -2)
    pp = pool_pos[:, :, None, :]
    visible = (pp >= 0) & (pp <= pos[:, None, :, None]) & valid_row[:, None, :, None]
    return scores, visible
