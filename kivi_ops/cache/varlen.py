"""One forward of a flattened, variable-length batch on a paged KIVI layer, in the form an engine's
metadata gives it (vLLM: query_start_loc, seq_lens, block_table, slot_mapping): request b owns tokens
[query_start_loc[b], query_start_loc[b + 1]) of query/key/value [T, heads, D], which take it from
seq_lens[b] - q_len to seq_lens[b] tokens. Its full-precision windows live in a pool of window
slots (k_window, v_window [slots, H, R, D], slot rows[b]), since the engine's blocks hold only the
quantized pages (byte_pages.py).

Each request appends its tokens (run_append: the one dispatcher picks the implementation) and attends:
a request that starts at token 0 (a prompt, or the first chunk of one) attends over its exact keys
and values, causally, as the library's prefill (Step(prefill=True)); any later chunk or decode token
attends over the cache (run_attend), as the library's own continuation. One-token decodes run as
one batch; longer chunks one request at a time (no padding to the longest).

With `chunk` (prefix caching) every chunk, a prompt's first included, attends through the cache and
is cut at the multiples of `chunk` (the library's prefill_chunked): the cache at such a boundary then
depends on the tokens before it alone, and `on_boundary(b, tokens)` runs when request b reaches one.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import dispatch
from .layer import run_append, run_attend
from ..layout import LayerTensors, QuantParams
from ..paged_layout import Paging


def expected_slots(block_table: Tensor, starts: list[int], ends: list[int], page_size: int) -> Tensor:
    """The slot (page id * page_size + row) of every new token: token t of request b lives at row
    t % PS of page block_table[b, t // PS], the paged layout's addressing (paged_layout.py)."""
    pos = torch.cat([torch.arange(s, e) for s, e in zip(starts, ends)]) if starts else torch.zeros(0, dtype=torch.long)
    req = torch.cat([torch.full((e - s,), b) for b, (s, e) in enumerate(zip(starts, ends))]) if starts else pos
    return block_table.long()[req, torch.div(pos, page_size, rounding_mode="floor")] * page_size + pos % page_size


def varlen_append_attend(query: Tensor, key: Tensor, value: Tensor, pools: LayerTensors, k_window: Tensor,
                         v_window: Tensor, rows: Tensor, block_table: Tensor, query_start_loc: Tensor,
                         seq_lens: Tensor, slot_mapping: Tensor, params: QuantParams, scale: float,
                         chunk: Optional[int] = None,
                         on_boundary: Optional[Callable[[int, int], None]] = None) -> Tensor:
    """Append and attend every request of the batch (module doc); returns [T, Hq, D] (rows past
    query_start_loc[-1] are zeros). pools: the layer's page pools (k_res/v_res/lengths unused).
    slot_mapping must agree with block_table (a mismatch means the engine's layout is not ours)."""
    qsl, sl = query_start_loc.tolist(), seq_lens.tolist()
    B, PS, W = len(sl), pools.k_codes.shape[2], k_window.shape[2]
    if W != params.residual_length:
        raise ValueError(f"k_window must hold residual_length={params.residual_length} tokens, got {W}")
    qlen = [qsl[b + 1] - qsl[b] for b in range(B)]
    ctx = [sl[b] - qlen[b] for b in range(B)]
    want = expected_slots(block_table, ctx, sl, PS)
    if not torch.equal(want, slot_mapping[:qsl[-1]].long()):
        raise ValueError("slot_mapping does not match block_table under the paged layout (token t at page "
                         f"block_table[b, t // {PS}], row t % {PS})")
    out = torch.zeros_like(query)
    decode = [b for b in range(B) if qlen[b] == 1 and ctx[b] > 0]
    if decode:
        _run(decode, 1, False, query, key, value, out, pools, k_window, v_window, rows, block_table, qsl, sl,
             params, scale)
        for b in decode:
            if chunk and on_boundary is not None and sl[b] % chunk == 0:
                on_boundary(b, sl[b])
    for b in range(B):
        if qlen[b] == 0 or b in decode:
            continue
        if not chunk:
            _run([b], qlen[b], ctx[b] == 0, query, key, value, out, pools, k_window, v_window, rows, block_table,
                 qsl, sl, params, scale)
            continue
        begin = ctx[b]
        while begin < sl[b]:
            end = min((begin // chunk + 1) * chunk, sl[b])
            # One sub-chunk of request b: its tokens [begin, end) of the flattened batch.
            sub_qsl = {b: qsl[b] + begin - ctx[b], b + 1: qsl[b] + end - ctx[b]}
            _run([b], end - begin, False, query, key, value, out, pools, k_window, v_window, rows, block_table,
                 sub_qsl, {b: end}, params, scale)
            if on_boundary is not None and end % chunk == 0:
                on_boundary(b, end)
            begin = end
    return out


def _attend_bucketed(q, layer: LayerTensors, table: Tensor, params: QuantParams, scale: float, batch: int,
                     page_size: int, whole=None) -> Tensor:
    """A decode batch's attention with the batch padded to `batch` rows and the table to a power of
    two pages: a compiled CPU attention (cpu_compiled.py) meets a few shapes, not one per length and
    batch. Padding rows have no tokens and no pages (their outputs are dropped). whole: the window
    pools when the batch's windows are their first rows (the padding rows read the rest, unseen)."""
    Bg, M = table.shape
    pad, width = batch - Bg, 1 << (M - 1).bit_length()
    grow = lambda t: torch.cat([t, t.new_zeros(pad, *t.shape[1:])])
    table = F.pad(table, (0, width - M))
    k_res, v_res = whole if whole is not None else (grow(layer.k_res), grow(layer.v_res))
    padded = layer._replace(k_res=k_res, v_res=v_res, lengths=grow(layer.lengths))
    o = run_attend(grow(q).contiguous(), padded, None, params, scale, pages=Paging(grow(table), page_size))
    return o[:Bg]


def _run(group, n, exact, query, key, value, out, pools, k_window, v_window, rows, block_table, qsl, sl, params,
         scale):
    idx = torch.tensor(group, dtype=torch.long)
    slots = rows.long()[idx]
    W = k_window.shape[2]
    # Enough pages for the longest sequence and never fewer than the window: the static view's
    # capacity S must not drop under R (the window's slot t % min(R, S) would move).
    M = max(-(-max(sl[b] for b in group) // pools.k_codes.shape[2]), -(-W // pools.k_codes.shape[2]))
    table = block_table[idx, :M]
    table = F.pad(table, (0, M - table.shape[1]))
    lengths = torch.tensor([sl[b] - n for b in group], dtype=torch.long)
    first = int(slots[0])
    # Slots in a run (the usual case: requests take slots in batch order) are a view, written in place.
    in_place = torch.equal(slots, torch.arange(first, first + len(group)))
    window = (lambda w: w[first:first + len(group)]) if in_place else (lambda w: w.index_select(0, slots))
    layer = pools._replace(k_res=window(k_window), v_res=window(v_window), lengths=lengths)
    tokens = torch.cat([torch.arange(qsl[b], qsl[b] + n) for b in group])
    shape = lambda t: t[tokens].view(len(group), n, t.shape[1], t.shape[2]).transpose(1, 2)  # [Bg, heads, n, D]
    q, k, v = shape(query), shape(key).contiguous(), shape(value).contiguous()
    pages = Paging(table, pools.k_codes.shape[2])
    # The reference append writes only the pages a request owns; the compiled one writes the pool's
    # last page as scratch (paged_layout.py), which is one of the engine's blocks here.
    with dispatch.cpu_kernels("reference"):
        run_append(layer, k, v, None, params, pages=pages)
    if exact:
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
    elif n == 1:
        whole = (k_window, v_window) if in_place and first == 0 else None
        o = _attend_bucketed(q, layer, table, params, scale, k_window.shape[0], pools.k_codes.shape[2], whole)
    else:
        o = run_attend(q.contiguous(), layer, None, params, scale, pages=pages)
    if not in_place:
        k_window.index_copy_(0, slots, layer.k_res)
        v_window.index_copy_(0, slots, layer.v_res)
    out[tokens] = o.transpose(1, 2).reshape(len(group) * n, o.shape[1], o.shape[3]).to(out.dtype)
