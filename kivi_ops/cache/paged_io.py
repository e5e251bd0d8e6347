"""Moving one sequence of a paged cache, bit for bit: to host memory and back (swapping), or into
another paged cache; its pages (via page_tensors()) and row state (row_tensors()). The block table
is the caller's."""

from __future__ import annotations

from typing import Optional, Sequence

import torch

HostSequence = dict[tuple[int, str, str], torch.Tensor]


def _index(pages: Sequence[int], device) -> torch.Tensor:
    return torch.tensor(list(pages), dtype=torch.long, device=device)


def _parts(cache):
    for i, layer in enumerate(cache.layers):
        yield i, "page", layer.page_tensors()
        yield i, "row", layer.row_tensors()


def save_sequence(cache, row: int, pages: Sequence[int]) -> HostSequence:
    """Host copies of row `row`'s pages (in this order) and row state (pinned on CUDA)."""
    out: HostSequence = {}
    idx = _index(pages, cache.device)
    pin = cache.device.type == "cuda"
    for i, kind, tensors in _parts(cache):
        for name, t in tensors.items():
            src = t.index_select(0, idx) if kind == "page" else t[row]
            host = torch.empty(src.shape, dtype=src.dtype, pin_memory=pin)
            host.copy_(src, non_blocking=pin)
            out[(i, kind, name)] = host
    if pin:
        torch.cuda.current_stream(cache.device).synchronize()
    return out


def sequence_bytes(cache, num_pages: int) -> int:
    return sum(t[0].nbytes * (num_pages if kind == "page" else 1)
               for _, kind, tensors in _parts(cache) for t in tensors.values())


def load_sequence(cache, row: int, pages: Sequence[int], saved: HostSequence) -> None:
    """Write a saved sequence back: its pages into `pages`, in order, and its row state into `row`."""
    idx = _index(pages, cache.device)
    for i, kind, tensors in _parts(cache):
        for name, t in tensors.items():
            src = saved[(i, kind, name)]
            if kind == "page":
                if src.shape[0] != len(pages):
                    raise ValueError(f"load_sequence: {len(pages)} page ids for a sequence saved with {src.shape[0]} pages")
                t.index_copy_(0, idx, src.to(t.device, non_blocking=True))
            else:
                t[row].copy_(src, non_blocking=True)


def move_row(cache, src: int, dst: int) -> None:
    """Row `src`'s state into row `dst`; its pages stay (the caller repoints the block table)."""
    for layer in cache.layers:
        for t in layer.row_tensors().values():
            t[dst].copy_(t[src])


def copy_sequence(dst, dst_row: Optional[int], dst_pages: Sequence[int], src, src_row: Optional[int],
                  src_pages: Sequence[int]) -> None:
    """Copy row src_row of `src` (same kind and settings) into dst_row of `dst`, src_pages[j] into
    dst_pages[j]; rows None: the pages only (prefix caching)."""
    if len(dst_pages) != len(src_pages):
        raise ValueError(f"copy_sequence: {len(dst_pages)} destination pages for {len(src_pages)} source pages")
    if len(dst.layers) != len(src.layers):
        raise ValueError("copy_sequence needs caches with the same layers")
    if (dst_row is None) != (src_row is None):
        raise ValueError(f"copy_sequence: dst_row ({dst_row}) and src_row ({src_row}) must both be rows or both None")
    dst_idx, src_idx = _index(dst_pages, dst.device), _index(src_pages, src.device)
    for (i, kind, mine), (_, _, theirs) in zip(_parts(dst), _parts(src)):
        if mine.keys() != theirs.keys():
            raise ValueError(f"copy_sequence: layer {i} holds {sorted(mine)} here and {sorted(theirs)} in the source")
        for name, t in mine.items():
            s = theirs[name]
            if t.shape[1:] != s.shape[1:]:
                raise ValueError(f"copy_sequence: layer {i} {name} has shape {list(s.shape)}, here {list(t.shape)}")
            if kind == "page":
                t.index_copy_(0, dst_idx, s.index_select(0, src_idx))
            elif dst_row is not None:
                t[dst_row].copy_(s[src_row])
