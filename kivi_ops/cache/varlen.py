"""One forward of a flattened variable-length batch on a paged KIVI layer, from engine metadata
(vLLM's query_start_loc, seq_lens, block_table, slot_mapping); the exact windows live in a pool of
window slots (k_window, v_window [slots, H, R, D]). A request starting at token 0 attends exactly
(prefill), later ones through the cache. With `chunk` (prefix caching) every chunk attends through
the cache and is cut at multiples of `chunk`; on_boundary(b, tokens) runs at each. The metadata is
the same for every layer of a step: `plan` reads it once, `run` carries it out on one layer."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import dispatch
from .layer import run_append, run_attend
from ..layout import LayerTensors, QuantParams
from ..paged_layout import Paging


def expected_slots(block_table: Tensor, starts: list[int], ends: list[int], page_size: int) -> Tensor:
    """The slot (page id * page_size + row) of every new token under the paged layout."""
    pos = torch.cat([torch.arange(s, e) for s, e in zip(starts, ends)]) if starts else torch.zeros(0, dtype=torch.long)
    req = torch.cat([torch.full((e - s,), b) for b, (s, e) in enumerate(zip(starts, ends))]) if starts else pos
    return block_table.long()[req, torch.div(pos, page_size, rounding_mode="floor")] * page_size + pos % page_size


@dataclass(frozen=True)
class Run:
    """One append + attend of `group`'s requests, n tokens each, from `lengths` (cloned per layer:
    the append advances it). mode: "exact" (prefill), "decode" (padded to a bucket) or "cache"."""
    group: list[int]
    n: int
    mode: str
    slots: Tensor
    first: int
    in_place: bool  # the slots are first, first + 1, ...: the windows are a view, written in place
    pages: Paging
    lengths: Tensor
    tokens: Tensor  # the group's rows of the flattened batch
    boundaries: tuple[tuple[int, int], ...]  # on_boundary(b, end) after this run
    bucket: Optional[tuple[Paging, Tensor, int]] = None  # decode: padded pages, lengths after, batch rows


@dataclass(frozen=True)
class VarlenPlan:
    runs: tuple[Run, ...]


def plan(rows: Tensor, block_table: Tensor, query_start_loc: Tensor, seq_lens: Tensor, slot_mapping: Tensor,
         page_size: int, residual_length: int, window_slots: int, chunk: Optional[int] = None) -> VarlenPlan:
    """The runs of one step. window_slots: the window pools' rows (decode pads to it)."""
    qsl, sl = query_start_loc.tolist(), seq_lens.tolist()
    B = len(sl)
    qlen = [qsl[b + 1] - qsl[b] for b in range(B)]
    ctx = [sl[b] - qlen[b] for b in range(B)]
    if not torch.equal(expected_slots(block_table, ctx, sl, page_size), slot_mapping[:qsl[-1]].long()):
        raise ValueError("slot_mapping does not match block_table under the paged layout (token t at page "
                         f"block_table[b, t // {page_size}], row t % {page_size})")
    rows = rows.long()

    def make_run(group, n, mode, begin, boundaries=()):
        idx = torch.tensor(group, dtype=torch.long)
        slots = rows[idx]
        ends = [begin[b] + n for b in group]
        # Never fewer pages than the window: a capacity under R would move the window's slot t % min(R, S).
        M = max(-(-max(ends) // page_size), -(-residual_length // page_size))
        table = F.pad(block_table[idx, :M], (0, M - min(M, block_table.shape[1])))
        first = int(slots[0])
        in_place = torch.equal(slots, torch.arange(first, first + len(group)))
        tokens = torch.cat([torch.arange(qsl[b] + begin[b] - ctx[b], qsl[b] + begin[b] - ctx[b] + n) for b in group])
        bucket = None
        if mode == "decode":
            pad, width = window_slots - len(group), 1 << (M - 1).bit_length()
            grown = torch.cat([F.pad(table, (0, width - M)), table.new_zeros(pad, width)])
            bucket = (Paging(grown, page_size), torch.tensor(ends + [0] * pad, dtype=torch.long), window_slots)
        return Run(group, n, mode, slots, first, in_place, Paging(table, page_size),
                   torch.tensor([begin[b] for b in group], dtype=torch.long), tokens, tuple(boundaries), bucket)

    runs = []
    decode = [b for b in range(B) if qlen[b] == 1 and ctx[b] > 0]
    if decode:
        ends = tuple((b, sl[b]) for b in decode if chunk and sl[b] % chunk == 0)
        runs.append(make_run(decode, 1, "decode", {b: ctx[b] for b in decode}, ends))
    for b in range(B):
        if qlen[b] == 0 or b in decode:
            continue
        if not chunk:
            runs.append(make_run([b], qlen[b], "exact" if ctx[b] == 0 else "cache", {b: ctx[b]}))
            continue
        begin = ctx[b]
        while begin < sl[b]:
            end = min((begin // chunk + 1) * chunk, sl[b])
            runs.append(make_run([b], end - begin, "cache", {b: begin}, ((b, end),) if end % chunk == 0 else ()))
            begin = end
    return VarlenPlan(tuple(runs))


def run(p: VarlenPlan, query: Tensor, key: Tensor, value: Tensor, pools: LayerTensors, k_window: Tensor,
        v_window: Tensor, params: QuantParams, scale: float,
        on_boundary: Optional[Callable[[int, int], None]] = None) -> Tensor:
    """Append and attend every request of the plan on one layer; returns [T, Hq, D]."""
    if k_window.shape[2] != params.residual_length:
        raise ValueError(f"k_window must hold residual_length={params.residual_length} tokens, "
                         f"got {k_window.shape[2]}")
    out = torch.zeros_like(query)
    for r in p.runs:
        _run(r, query, key, value, out, pools, k_window, v_window, params, scale)
        if on_boundary is not None:
            for b, end in r.boundaries:
                on_boundary(b, end)
    return out


def varlen_append_attend(query: Tensor, key: Tensor, value: Tensor, pools: LayerTensors, k_window: Tensor,
                         v_window: Tensor, rows: Tensor, block_table: Tensor, query_start_loc: Tensor,
                         seq_lens: Tensor, slot_mapping: Tensor, params: QuantParams, scale: float,
                         chunk: Optional[int] = None,
                         on_boundary: Optional[Callable[[int, int], None]] = None) -> Tensor:
    """plan + run, for one layer (an engine with many layers plans once per step)."""
    p = plan(rows, block_table, query_start_loc, seq_lens, slot_mapping, pools.k_codes.shape[2],
             params.residual_length, k_window.shape[0], chunk)
    return run(p, query, key, value, pools, k_window, v_window, params, scale, on_boundary)


def _run(r: Run, query, key, value, out, pools, k_window, v_window, params, scale):
    count = len(r.group)
    window = (lambda w: w[r.first:r.first + count]) if r.in_place else (lambda w: w.index_select(0, r.slots))
    layer = pools._replace(k_res=window(k_window), v_res=window(v_window), lengths=r.lengths.clone())
    shape = lambda t: t[r.tokens].view(count, r.n, t.shape[1], t.shape[2]).transpose(1, 2)  # [Bg, heads, n, D]
    q, k, v = shape(query), shape(key).contiguous(), shape(value).contiguous()
    # The reference append writes only the pages a request owns; the compiled one writes the pool's
    # last page as scratch (paged_layout.py), which is one of the engine's blocks here.
    with dispatch.cpu_kernels("reference"):
        run_append(layer, k, v, None, params, pages=r.pages)
    if r.mode == "exact":
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
    elif r.mode == "decode":
        o = _attend_bucketed(q, layer, r, params, scale, k_window, v_window)
    else:
        o = run_attend(q.contiguous(), layer, None, params, scale, pages=r.pages)
    if not r.in_place:
        k_window.index_copy_(0, r.slots, layer.k_res)
        v_window.index_copy_(0, r.slots, layer.v_res)
    out[r.tokens] = o.transpose(1, 2).reshape(count * r.n, o.shape[1], o.shape[3]).to(out.dtype)


def _attend_bucketed(q, layer: LayerTensors, r: Run, params: QuantParams, scale: float, k_window, v_window):
    """A decode batch's attention padded to the pools' rows and a power-of-two table, so compiled CPU
    attention meets a few shapes; padding rows have no tokens and no pages."""
    pages, lengths, batch = r.bucket
    count = len(r.group)
    grow = lambda t: torch.cat([t, t.new_zeros(batch - count, *t.shape[1:])])
    k_res, v_res = (k_window, v_window) if r.in_place and r.first == 0 else (grow(layer.k_res), grow(layer.v_res))
    padded = layer._replace(k_res=k_res, v_res=v_res, lengths=lengths)
    return run_attend(grow(q).contiguous(), padded, None, params, scale, pages=pages)[:count]
