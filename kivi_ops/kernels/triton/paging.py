"""The block-table indirection of the Triton cache kernels (paged layers, paged_layout.py).

Every address of a quantized buffer in the kernels is a row index times the row width; in the
static layout row i (a token, or a key group) of kv row bh = b * H + h is bh * N + i (N rows per
kv row: S tokens or NSG key groups). A paged layer keeps row i in page block_table[b, i // PER_PAGE]
(PER_PAGE: page_size tokens, or page_size / G key groups) at row i % PER_PAGE of that page's head h:
(page * H + h) * PER_PAGE + i % PER_PAGE. `cache_row` is that choice, made at compile time by the
PAGED flag: off, it is the static expression itself, so the static kernels compile as before.

Launch arguments (paging_args): block_table, MAXP (its columns), NPAGES (pool rows: the ids are
clamped into the pool; entries past a row's pages may hold anything and are masked by length),
PAGE (page size, constexpr), PAGED (constexpr). Static launches pass a dummy pointer and PAGED
False.
"""

from __future__ import annotations

from typing import NamedTuple

import triton
import triton.language as tl


class Pages(NamedTuple):
    """Inside the kernels: the block table [B, MAXP] (int32), the pool's NPAGES pages of PAGE
    tokens, H kv heads, and the PAGED flag (False: the static layout)."""
    block_table: object
    MAXP: object
    NPAGES: object
    H: object
    PAGE: object
    PAGED: object


@triton.jit
def cache_row(bh64, i, N, pg, PER_PAGE: tl.constexpr):
    """int64 row of logical row i (token or key group; scalar or tensor) of kv row bh64 = b * H + h:
    bh64 * N + i in the static layout, through the block table when pg.PAGED."""
    if pg.PAGED:
        b = bh64 // pg.H
        h = bh64 % pg.H
        j = i // PER_PAGE
        page = tl.load(pg.block_table + b * pg.MAXP + j, mask=j < pg.MAXP, other=0).to(tl.int64)
        page = tl.minimum(tl.maximum(page, 0), pg.NPAGES - 1)
        return (page * pg.H + h) * PER_PAGE + i % PER_PAGE
    else:
        return bh64 * N + i


def paging_args(pages, t, group_size: int) -> dict:
    """The launch arguments of the indirection: pages (a paged_layout.Paging) or None (static);
    t: the layer's LayerTensors (its lengths are the dummy pointer of a static launch, never
    read; its k_codes pool gives NPAGES)."""
    if pages is None:
        return dict(block_table=t.lengths, MAXP=1, NPAGES=1, PAGE=group_size, PAGED=False)
    table = pages.block_table
    if not table.is_contiguous():
        raise ValueError("block_table must be contiguous")
    return dict(block_table=table, MAXP=table.shape[1], NPAGES=t.k_codes.shape[0], PAGE=pages.page_size, PAGED=True)


def static_dims(t, p, pages):
    """check_cache's (B, H, S, D, R, RR, G, Gv) for a paged layer (paged_layout.py): the row
    tensors checked; S is the row capacity max_pages * page_size. Shapes of the pools are the
    op's check (paged_ops.check_paged)."""
    from ..reference.packing import token_group_size
    from ...layout import REQUIRED_TENSORS

    for name, x in zip(REQUIRED_TENSORS, t.kivi):
        if not x.is_contiguous():
            raise ValueError(f"cache buffer {name} must be contiguous (a whole registered buffer)")
    B, H, RR, D = t.k_res.shape
    R, G = p.residual_length, p.group_size
    S = pages.capacity
    if tuple(t.v_res.shape) != (B, H, min(R, S), D) or RR != min(R, S):
        raise ValueError(f"k_res/v_res must have shape {(B, H, min(R, S), D)}")
    return B, H, S, D, R, RR, G, token_group_size(G, D)

