"""The block-table indirection of the Triton cache kernels (paged layers, paged_layout.py): `cache_row`,
compiled by the PAGED flag; off, it is the static row expression, so static kernels are unchanged.
Page ids are clamped into the pool; entries past a row's pages are masked by length."""

from __future__ import annotations

from typing import NamedTuple

import triton
import triton.language as tl


class Pages(NamedTuple):
    block_table: object
    MAXP: object
    NPAGES: object
    H: object
    PAGE: object
    PAGED: object


@triton.jit
def cache_row(bh64, i, N, pg, PER_PAGE: tl.constexpr):
    """int64 row of logical row i of kv row bh64: bh64 * N + i, through the block table when paged."""
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
    """Launch arguments of the indirection; pages None: static (a dummy pointer, never read)."""
    if pages is None:
        return dict(block_table=t.lengths, MAXP=1, NPAGES=1, PAGE=group_size, PAGED=False)
    table = pages.block_table
    if not table.is_contiguous():
        raise ValueError("block_table must be contiguous")
    return dict(block_table=table, MAXP=table.shape[1], NPAGES=t.k_codes.shape[0], PAGE=pages.page_size, PAGED=True)


def static_dims(t, p, pages):
    """check_cache's dims for a paged layer; S is the row capacity max_pages * page_size."""
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

