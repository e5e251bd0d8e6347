"""The bytes of prefix caching (`kivi serve --paged --prefix-caching`): what a cached prefix keeps
besides its shared pages, and how a new sequence starts from it. The block manager
(block_manager.py, pure Python) decides which prefix a request takes and holds the page
references; this module moves the bytes (kivi_ops.cache.paged_io).

A prefix of b tokens (b a multiple of the prefill chunk, models/generate.prefill_chunked) splits
into pages [0, pages_final(b)), which no later append writes (KIVI: every token of them has its key
and value quantized; fp: the full pages) and which are shared by reference, and the rest, which
the sequence keeps writing: the pages [pages_final(b), pages_needed(b)) still being filled (KIVI's
next key groups and the values leaving the window; fp's partial last page) and the row state (the
length, KIVI's full-precision windows). That rest is the `tail`, a host copy taken at the boundary
(paged_io.save_sequence, as a swap saves a sequence), bounded by the block manager's count of
cached prefixes. A hit copies the shared pages and the tail into the sequence's own pages and row,
so it continues exactly as if it had prefilled those b tokens itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from kivi_ops.cache.paged_io import HostSequence, copy_sequence, load_sequence, save_sequence


@dataclass(frozen=True)
class Tail:
    """A cached prefix's tail: host copies of `num_pages` pages and the row state."""

    num_pages: int
    saved: HostSequence


def save_tail(cache, row: int, pages: Sequence[int], num_tokens: int) -> Tail:
    """The tail of row `row` of a paged cache right now, holding num_tokens tokens in `pages` (its
    pages in table order): host copies of its pages past pages_final and its row state."""
    tail = list(pages[cache.pages_final(num_tokens):cache.pages_needed(num_tokens)])
    return Tail(len(tail), save_sequence(cache, row, tail))


def restore_prefix(dst, row: int, pages: Sequence[int], src, shared: Sequence[int], tail: Tail) -> None:
    """Make row `row` of dst (a fresh sequence; `pages` its pages in table order, at least
    pages_needed of the prefix) the cached prefix: the shared pages of src (the pages a cached
    prefix holds, in order) copied into its first pages, then the tail into the next ones and the
    row. dst may be src itself (other pages) or another paged cache of the same settings."""
    n = len(shared)
    if len(pages) < n + tail.num_pages:
        raise ValueError(f"restore_prefix: {len(pages)} pages for a prefix of {n} shared + {tail.num_pages} tail pages")
    copy_sequence(dst, None, list(pages[:n]), src, None, list(shared))
    load_sequence(dst, row, list(pages[n:n + tail.num_pages]), tail.saved)
