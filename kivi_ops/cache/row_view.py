"""A paged cache's first rows, as a cache of their own.

A server's decode step runs over every row of its cache, and a compiled step costs every row
whether it holds a request or not. `kivi serve --paged` therefore keeps its requests in the lowest
rows and runs the step over the first `rows` of them only, rounded up to one of a few bucket
sizes, each compiled once (vLLM's batch-size buckets for CUDA graphs).

The view shares everything with the cache: the page pools as they are, and the row state (each
layer's `row_tensors()`: lengths, the full-precision windows) and the block table as views of
their first rows. A step over the view writes into the cache itself, and computes for each of
those rows what a step over the whole cache computes for it (the ops work row by row).
"""

from __future__ import annotations

import copy

import torch
from torch import nn


def leading_rows(cache, rows: int):
    """`cache` (a paged cache: PagedKIVICache or PagedFPCache) seen through its first `rows` rows
    (1 <= rows <= cache.batch_size; all of them: the cache itself)."""
    if isinstance(rows, bool) or not isinstance(rows, int) or not 1 <= rows <= cache.batch_size:
        raise ValueError(f"rows must be an int in [1, {cache.batch_size}] (the cache's rows), got {rows!r}")
    if rows == cache.batch_size:
        return cache
    table = cache.block_table[:rows]
    view = copy.copy(cache)  # a module's copy shares its dicts of buffers and submodules: new ones below
    _set_table(view, cache, table)
    view._modules = {**cache._modules, "layers": nn.ModuleList([_layer_rows(layer, rows, table)
                                                                 for layer in cache.layers])}
    if cache.device.type == "cuda":
        # CUDA graphs update in place only tensors at fixed addresses; these views are kept (the
        # server keeps one view per bucket) and point into the cache's fixed buffers.
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
    """The view's own dict of buffers, with `table` as its block table: a registered buffer in some
    modules (the paged KIVI cache, the paged fp layer), a plain attribute in others."""
    view._buffers = dict(module._buffers)
    if "block_table" in module._buffers:
        view._buffers["block_table"] = table
    else:
        view.__dict__["block_table"] = table
