"""The bytes of prefix caching: a cached prefix's tail (what is not shared) and restoring from it (docs/serve.md)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from kivi_ops.cache.paged_io import HostSequence, copy_sequence, load_sequence, save_sequence


@dataclass(frozen=True)
class Tail:

    num_pages: int
    saved: HostSequence


def save_tail(cache, row: int, pages: Sequence[int], num_tokens: int) -> Tail:
    """Host copies of row `row`'s pages past pages_final(num_tokens), and its row state."""
    tail = list(pages[cache.pages_final(num_tokens):cache.pages_needed(num_tokens)])
    return Tail(len(tail), save_sequence(cache, row, tail))


def restore_prefix(dst, row: int, pages: Sequence[int], src, shared: Sequence[int], tail: Tail) -> None:
    """Make row `row` of dst the cached prefix: the shared pages of src, then the tail. dst may be src."""
    n = len(shared)
    if len(pages) < n + tail.num_pages:
        raise ValueError(f"restore_prefix: {len(pages)} pages for a prefix of {n} shared + {tail.num_pages} tail pages")
    copy_sequence(dst, None, list(pages[:n]), src, None, list(shared))
    load_sequence(dst, row, list(pages[n:n + tail.num_pages]), tail.saved)
