"""The paged KIVI layout (docs/cache.md, "The paged cache"): the six quantized buffers of layout.py
as pools [N + 1, H, PS or PS/G, ...] of N pages of PS tokens plus a scratch page (id N, written by
rows that write nothing, never read, never handed out); k_res, v_res and lengths stay per row.
Token t of row b lives at row t % PS of page block_table[b, t // PS] (key scales: (t // G) % (PS/G)).
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
    block_table: Tensor
    page_size: int

    @property
    def max_pages(self) -> int:
        return self.block_table.shape[1]

    @property
    def capacity(self) -> int:
        return self.block_table.shape[1] * self.page_size


def pages_needed(num_tokens: int, page_size: int, residual_length: int, group_size: int | None = None) -> int:
    """Pages a sequence of num_tokens holds at most (keys quantized R at a time; values fewer). Allocate
    pages_needed(L + n) before an append from L to L + n tokens; group_size, if given, is checked."""
    for name, value in (("num_tokens", num_tokens), ("page_size", page_size), ("residual_length", residual_length)):
        if isinstance(value, bool) or not isinstance(value, int) or value < (0 if name == "num_tokens" else 1):
            raise ValueError(f"{name} must be a {'non-negative' if name == 'num_tokens' else 'positive'} int, "
                             f"got {value!r}")
    if group_size is not None:
        check_page_size(page_size, group_size)
    quantized = num_tokens // residual_length * residual_length
    return -(-quantized // page_size)


def pages_final(num_tokens: int, page_size: int, residual_length: int) -> int:
    """Pages [0, pages_final) whose keys and values are all quantized: no later append writes them."""
    pages_needed(num_tokens, page_size, residual_length)
    return max(num_tokens - residual_length, 0) // page_size


def check_page_size(page_size, group_size: int) -> None:
    if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size <= 0 or page_size % group_size:
        raise ValueError(f"page_size must be a positive multiple of group_size={group_size} (a page holds whole "
                         f"key groups), got {page_size!r}")


def page_rows(pool: Tensor, block_table: Tensor) -> Tensor:
    """pool [N + 1, H, X, ...] through block_table [B, M] as [B, H, M * X, ...], a contiguous gather;
    ids are clamped into the pool (what stale entries point to is masked by length)."""
    B, M = block_table.shape
    ids = block_table.long().clamp(0, pool.shape[0] - 1).reshape(-1)
    gathered = torch.index_select(pool, 0, ids).view(B, M, *pool.shape[1:])
    return gathered.transpose(1, 2).reshape(B, pool.shape[1], M * pool.shape[2], *pool.shape[3:]).contiguous()


def page_rows_indexed(pool: Tensor, block_table: Tensor) -> Tensor:
    """page_rows as one aten.index expression, which Inductor inlines as an indirect load into the
    loops that read it, so nothing of the cache's size is written (eagerly a copy)."""
    B, M = block_table.shape
    X = pool.shape[2]
    r = torch.arange(M * X, device=pool.device)
    page = block_table.long().clamp(0, pool.shape[0] - 1)[:, torch.div(r, X, rounding_mode="floor")]
    heads = torch.arange(pool.shape[1], device=pool.device)
    return pool[page[:, None, :], heads[None, :, None], torch.remainder(r, X)[None, None, :]]


def indexed_view(layer: LayerTensors, block_table: Tensor) -> LayerTensors:
    return layer._replace(**{name: page_rows_indexed(getattr(layer, name), block_table) for name in PAGED_TENSORS})


def static_view(layer: LayerTensors, block_table: Tensor) -> LayerTensors:
    """The paged tensors gathered into the static layout of capacity M * PS. Contiguous on purpose: CPU
    float matmuls (MKL) round differently for other strides, which would break equality with static."""
    return layer._replace(**{name: page_rows(getattr(layer, name), block_table) for name in PAGED_TENSORS})


def check_paged_layer(layer: LayerTensors, block_table: Tensor, group_size: int) -> int:
    """The block table against the pools, without a host sync; returns the page size."""
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
    if isinstance(page_size, int):  # a SymInt (dynamic shapes) is checked by the shapes below
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
