"""Reference (plain PyTorch) paged append and attention: the CPU kernels of the paged cache ops, and
the specification the paged decomposed and Triton forms are tested against.

Each is the static reference (reference.py) run on the static view of the pages (paged_layout.py):
attention reads the layer gathered through the block table; an append gathers each row's pages,
runs append_reference on that one-row static layer (its residuals and length are views of the
paged layer's, so they update in place), and writes back the pages the append wrote. Same code
as the static cache, so the same bits.
"""

from __future__ import annotations

import torch

from ..layout import LayerTensors, QuantParams
from ..paged_layout import PAGED_TENSORS, Paging, static_view
from .reference import append_reference, attend_reference, check_capacity


def paged_append_reference(layer: LayerTensors, key, value, counts, params: QuantParams, pages: Paging) -> None:
    """append_reference on a paged layer (module doc). Row b must hold the pages that cover the
    quantized tokens after the append (paged_layout.pages_needed); it writes only pages
    [q0 // PS, ceil(nqk_end / PS)): the first holding a value that leaves the window (q0 =
    max(L - R, 0)) to the last holding a flushed key."""
    B, _, n, _ = key.shape
    R, PS = params.residual_length, pages.page_size
    check_capacity(layer.lengths, counts, n, pages.capacity)
    counts_list = [n] * B if counts is None else counts.tolist()
    for b, c in enumerate(counts_list):
        if c == 0:
            continue
        L = int(layer.lengths[b])
        table = pages.block_table[b:b + 1]
        row = layer._replace(k_res=layer.k_res[b:b + 1], v_res=layer.v_res[b:b + 1], lengths=layer.lengths[b:b + 1])
        view = static_view(row, table)
        append_reference(view, key[b:b + 1], value[b:b + 1], None if counts is None else counts[b:b + 1], params)
        first, stop = max(L - R, 0) // PS, -(-((L + c) // R * R) // PS)
        ids = table[0, first:stop].long()
        if len(ids) == 0:
            continue
        for name in PAGED_TENSORS:
            pool, rows = getattr(layer, name), getattr(view, name)
            per_page = pool.shape[2]
            written = rows[0, :, first * per_page:stop * per_page]  # [H, pages * per_page, ...]
            pool[ids] = written.reshape(pool.shape[1], len(ids), per_page, *pool.shape[3:]).transpose(0, 1)


def paged_attend_reference(query, layer: LayerTensors, counts, params: QuantParams, scale: float,
                           pages: Paging) -> torch.Tensor:
    """attend_reference on the static view of a paged layer (module doc)."""
    return attend_reference(query, static_view(layer, pages.block_table), counts, params, scale)


