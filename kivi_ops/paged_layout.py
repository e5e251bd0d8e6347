"""The paged KIVI layout: what a page holds, the block table, and the static view of a paged layer.

A paged layer keeps the *quantized* part of every sequence in a pool of pages shared by all rows,
and the full-precision residual windows per row, as the static layer does (layout.py):

    per page (N pages of PS tokens, PS a multiple of G, plus one scratch page, id N):
    k_codes  uint8 [N + 1, H, PS, D*kb/8]    keys quantized per channel, packed along D
    k_scale  dtype [N + 1, H, PS/G, D]       one scale/zero per (group of G tokens, channel):
    k_zero   dtype [N + 1, H, PS/G, D]       a page holds PS/G whole key groups
    v_codes  uint8 [N + 1, H, PS, D*vb/8]    values quantized per token
    v_scale  dtype [N + 1, H, PS, D/Gv]
    v_zero   dtype [N + 1, H, PS, D/Gv]
    per sequence row (B rows):
    k_res    dtype [B, H, min(R, S), D]      full-precision key residual (as the static layer)
    v_res    dtype [B, H, min(R, S), D]      full-precision value window (ring)
    lengths  int64 [B]
    per cache (every layer reads the same tensor):
    block_table int32 [B, M]                 page ids: page j of row b holds the quantized tokens
                                             [j * PS, (j + 1) * PS) of that row's sequence

S = M * PS is a row's capacity. Token t of row b lives at row t % PS of page block_table[b, t // PS]
(key scales: row (t // G) % (PS / G)). In the static layout the same token lives at row t of batch
row b, so the paged layer is the static one with a block-table indirection on the quantized
buffers' rows; the residual windows, lengths and the streaming policy are unchanged.

Which pages a row must hold: the ones covering its quantized tokens. Keys are quantized R at a
time (nqk = L // R * R) and values one at a time as they leave the window (nqv = L - R < nqk), so a
row of length L uses pages [0, ceil(nqk / PS)): `pages_needed`. Before an append of n tokens the
block manager makes sure the row holds pages_needed(L + n) pages. Entries past those may hold
anything: they are never read (the kernels clamp every id into the pool and mask by length).

A page is written while tokens of it are quantized and never after: once a row's length reaches
(j + 1) * PS + R, page j holds only quantized keys and values and stays as it is (it can be shared
by reference, or swapped to host and back bit for bit).

The scratch page (id N = `num_pages`): the static-shape append form (decomposed_append, torch.compile
and exports) writes every row's candidate rows each call; rows that write nothing there send their
writes to it, so no row ever touches a page it does not own. It is never read. Block tables must not
hand it out.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from .layout import LayerTensors

BLOCK_TABLE_DTYPE = torch.int32
PAGED_TENSORS = ("k_codes", "k_scale", "k_zero", "v_codes", "v_scale", "v_zero")
ROW_TENSORS = ("k_res", "v_res", "lengths")


class Paging(NamedTuple):
    """How a paged layer's quantized buffers are addressed: the block table [B, M] (page ids) and
    the page size PS in tokens. Static layers have none (None where a Paging is taken)."""

    block_table: Tensor
    page_size: int

    @property
    def max_pages(self) -> int:
        return self.block_table.shape[1]

    @property
    def capacity(self) -> int:
        """Tokens a row can hold: max_pages_per_seq * page_size (the static layout's S)."""
        return self.block_table.shape[1] * self.page_size


def pages_needed(num_tokens: int, page_size: int, residual_length: int, group_size: int | None = None) -> int:
    """Pages a sequence of num_tokens tokens holds at most under KIVI's streaming policy (keys
    quantized R = residual_length at a time; values one at a time as they leave the window of the
    last R, always fewer): ceil((num_tokens // R * R) / page_size). Allocate pages_needed(L + n)
    before an append that takes a row from L to L + n tokens: the append may flush a key window.
    group_size, when given, is checked against page_size (a page holds whole key groups)."""
    for name, value in (("num_tokens", num_tokens), ("page_size", page_size), ("residual_length", residual_length)):
        if isinstance(value, bool) or not isinstance(value, int) or value < (0 if name == "num_tokens" else 1):
            raise ValueError(f"{name} must be a {'non-negative' if name == 'num_tokens' else 'positive'} int, "
                             f"got {value!r}")
    if group_size is not None:
        check_page_size(page_size, group_size)
    quantized = num_tokens // residual_length * residual_length
    return -(-quantized // page_size)


def pages_final(num_tokens: int, page_size: int, residual_length: int) -> int:
    """Pages [0, pages_final) of a sequence of num_tokens tokens that are final: every token of them
    has its key and its value quantized (nqv = num_tokens - R is the smaller count), so no later
    append writes them again; prefix caching shares them by reference. The pages after them, up to
    pages_needed, are still being written."""
    pages_needed(num_tokens, page_size, residual_length)  # checks the arguments
    return max(num_tokens - residual_length, 0) // page_size


def check_page_size(page_size, group_size: int) -> None:
    if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size <= 0 or page_size % group_size:
        raise ValueError(f"page_size must be a positive multiple of group_size={group_size} (a page holds whole "
                         f"key groups), got {page_size!r}")


def page_rows(pool: Tensor, block_table: Tensor) -> Tensor:
    """pool [N + 1, H, X, ...] seen through block_table [B, M] as the static layout [B, H, M * X,
    ...] (a gather: a copy, contiguous like the static buffers). Ids are clamped into the pool
    (entries past a row's pages may hold anything; what they point to is masked by length)."""
    B, M = block_table.shape
    ids = block_table.long().clamp(0, pool.shape[0] - 1).reshape(-1)
    gathered = torch.index_select(pool, 0, ids).view(B, M, *pool.shape[1:])  # [B, M, H, X, ...]
    return gathered.transpose(1, 2).reshape(B, pool.shape[1], M * pool.shape[2], *pool.shape[3:]).contiguous()


def page_rows_indexed(pool: Tensor, block_table: Tensor) -> Tensor:
    """pool [N + 1, H, X, ...] seen through block_table [B, M] as [B, H, M * X, ...], the values of
    page_rows but as one advanced-indexing expression (aten.index) instead of a gather, a permute
    and a contiguous copy: traced by torch.compile, Inductor inlines it into the loops that read it
    as an indirect load (row t of sequence b: page block_table[b, t // X], row t % X), so nothing
    of the size of the cache is written. Eagerly it is a copy like page_rows (strided the same)."""
    B, M = block_table.shape
    X = pool.shape[2]
    r = torch.arange(M * X, device=pool.device)
    page = block_table.long().clamp(0, pool.shape[0] - 1)[:, torch.div(r, X, rounding_mode="floor")]  # [B, S]
    heads = torch.arange(pool.shape[1], device=pool.device)
    return pool[page[:, None, :], heads[None, :, None], torch.remainder(r, X)[None, None, :]]


def indexed_view(layer: LayerTensors, block_table: Tensor) -> LayerTensors:
    """static_view's tensors as page_rows_indexed expressions (no copies under Inductor): what the
    fused decode attention (decomposed_attend.attend_fused) reads on a paged layer."""
    return layer._replace(**{name: page_rows_indexed(getattr(layer, name), block_table) for name in PAGED_TENSORS})


def static_view(layer: LayerTensors, block_table: Tensor) -> LayerTensors:
    """The paged layer's tensors in the static layout (layout.py) of capacity S = M * PS: the
    quantized buffers gathered through the block table (contiguous copies), the row tensors as
    they are. What the reference attention, the decomposed attention forms and dequantized() read.
    Rows a sequence has not quantized hold whatever the page held (attention masks them, as the
    static layer's unused rows). Contiguous matters for the bits: the CPU's float matmuls (MKL)
    round differently for other strides (a one-row page's reshape would keep the gather's)."""
    return layer._replace(**{name: page_rows(getattr(layer, name), block_table) for name in PAGED_TENSORS})


def check_paged_layer(layer: LayerTensors, block_table: Tensor, group_size: int) -> int:
    """The block table against the pools (no values read: no host sync). Returns the page size."""
    if not isinstance(block_table, Tensor) or block_table.dim() != 2:
        raise ValueError(f"block_table must be a 2-D int tensor [batch, max_pages_per_seq], got "
                         f"{getattr(block_table, 'shape', block_table)}")
    if block_table.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"block_table must be int32 or int64, got {block_table.dtype}")
    B = layer.lengths.shape[0]
    if block_table.shape[0] != B:
        raise ValueError(f"block_table must have one row per sequence ({B}), got {list(block_table.shape)}")
    if block_table.device != layer.lengths.device:
        raise ValueError(f"block_table must be on the cache device {layer.lengths.device}, got {block_table.device}")
    page_size = layer.k_codes.shape[2]
    if isinstance(page_size, int):  # a SymInt (dynamic-shape tracing) is checked by the shapes below
        check_page_size(page_size, group_size)
    pages = layer.k_codes.shape[0]
    for name in PAGED_TENSORS:
        t = getattr(layer, name)
        if t.shape[0] != pages or t.shape[1] != layer.k_res.shape[1]:
            raise ValueError(f"{name} must be a page pool [pages + 1 = {pages}, heads, ...], got {list(t.shape)}")
    if layer.k_scale.shape[2] * group_size != page_size or layer.v_codes.shape[2] != page_size:
        raise ValueError(f"k_scale must hold page_size / group_size = {page_size // group_size} rows per page and "
                         f"v_codes page_size = {page_size}")
    return page_size
