"""A paged cache's first rows as a cache of their own, sharing its pools and viewing its row state
and block table: `kivi serve --paged` runs a compiled step over a bucket of the lowest rows only."""

from __future__ import annotations

import copy

import torch
from torch import nn


def leading_rows(cache, rows: int):
    if isinstance(rows, bool) or not isinstance(rows, int) or not 1 <= rows <= cache.batch_size:
        raise ValueError(f"rows must be an int in [1, {cache.batch_size}] (the cache's rows), got {rows!r}")
    if rows == cache.batch_size:
        return cache
    table = cache.block_table[:rows]
    view = copy.copy(cache)  # shares the dicts of buffers and submodules: new ones below
    _set_table(view, cache, table)
    view._modules = {**cache._modules, "layers": nn.ModuleList([_layer_rows(layer, rows, table)
                                                                 for layer in cache.layers])}
    if cache.device.type == "cuda":
        # CUDA graphs update in place only tensors at fixed addresses: these views point into the cache's.
        for buf in view.buffers():
            torch._dynamo.mark_static_address(buf)
    return view


def _layer_rows(layer, rows: int, table: torch.Tensor):
    view = copy.copy(layer)
    _set_table(view, layer, table)
    for name, t in layer.row_tensors().items():
        view._buffers[name] = t[:rows]
    view.batch_size = rows
    return view


def _set_table(view, module, table: torch.Tensor) -> None:
    """The view's own dict of buffers with `table` as its block table (a buffer or a plain attribute)."""
    view._buffers = dict(module._buffers)
    if "block_table" in module._buffers:
        view._buffers["block_table"] = table
    else:
        view.__dict__["block_table"] = table
