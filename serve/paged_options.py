"""`kivi serve --paged`'s options and their defaults (docs/serve.md, Paged and Prefix caching)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from kivi_models.generate import MAX_COMPILED_SHAPES
from kivi_ops.cache.paged_io import sequence_bytes

def check_prefix_caching(paging: "PagedServing", page_size: int) -> None:
    chunk, kept, nbytes = paging.prefix_chunk, paging.max_prefixes, paging.max_prefix_bytes
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk <= 0 or chunk % page_size:
        raise ValueError(f"--prefix-chunk must be a positive multiple of the page size ({page_size} tokens, "
                         f"--page-size), got {chunk!r}")
    if kept is not None and (isinstance(kept, bool) or not isinstance(kept, int) or kept < 0):
        raise ValueError(f"--prefix-cache-size must be an int >= 0, got {kept!r}")
    if nbytes is not None and (isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes <= 0):
        raise ValueError(f"--prefix-cache-gib must be a positive number of bytes, got {nbytes!r}")


# --prefix-cache-size's default: as many tails as this holds (Llama-2-7B KIVI-2: 80 MB, so 53), at most 256.
PREFIX_HOST_BYTES = 4 * 2**30
DEFAULT_MAX_PREFIXES = 256


def tail_pages(cache, num_tokens: int) -> int:
    return cache.pages_needed(num_tokens) - cache.pages_final(num_tokens)


def largest_tail_bytes(cache, chunk: int, max_seq_len: int) -> int:
    largest = max((tail_pages(cache, b) for b in range(chunk, max_seq_len + 1, chunk)),
                  default=0)  # a chunk longer than any sequence: no prefix is ever cached
    return sequence_bytes(cache, largest)


def default_max_prefixes(cache, chunk: int, max_seq_len: int) -> int:
    return max(1, min(DEFAULT_MAX_PREFIXES, PREFIX_HOST_BYTES // largest_tail_bytes(cache, chunk, max_seq_len)))


def prefix_bytes(paging: "PagedServing", cache, max_seq_len: int) -> int:
    """--prefix-cache-gib in bytes: at least the largest tail (else some prefixes are never kept, silently)."""
    largest = largest_tail_bytes(cache, paging.prefix_chunk, max_seq_len)
    if paging.max_prefix_bytes is None:
        return max(cache.nbytes(), largest)
    if paging.max_prefix_bytes < largest:
        raise ValueError(f"--prefix-cache-gib {paging.max_prefix_bytes / 2**30:.6g} holds no cached prefix of the "
                         f"longest prompts: one keeps a host copy of up to {largest / 2**20:.2f} MiB "
                         f"({largest / 2**30:.6g} GiB) here; give at least that")
    return paging.max_prefix_bytes


@dataclass(frozen=True)
class PagedServing:

    num_pages: int
    page_size: Optional[int] = None
    prefix_chunk: Optional[int] = None
    max_prefixes: Optional[int] = None
    decode_buckets: Optional[tuple[int, ...]] = None
    max_prefix_bytes: Optional[int] = None


SMALLEST_BUCKET = 8
# Each default bucket is a graph compiled at warm-up; past MAX_COMPILED_SHAPES a step would run eagerly.
DEFAULT_MAX_BUCKETS = 8


def decode_buckets(rows: int, chosen: Optional[tuple[int, ...]] = None) -> tuple[int, ...]:
    if chosen is None:
        powers = [2**k for k in range(SMALLEST_BUCKET.bit_length() - 1, rows.bit_length()) if 2**k < rows]
        chosen = tuple(powers[-(DEFAULT_MAX_BUCKETS - 1):])
    if any(isinstance(b, bool) or not isinstance(b, int) or not 1 <= b <= rows for b in chosen):
        raise ValueError(f"--decode-buckets must be row counts in [1, {rows}] (--max-batch), got {list(chosen)}")
    buckets = tuple(sorted({*chosen, rows}))
    if len(buckets) > MAX_COMPILED_SHAPES:
        raise ValueError(f"--decode-buckets: at most {MAX_COMPILED_SHAPES} row counts, --max-batch ({rows}) included "
                         f"(each is a compiled decode step), got {len(buckets)}")
    return buckets


def engine_buckets(paging: Optional[PagedServing], slots: int) -> tuple[int, ...]:
    return (slots,) if paging is None else decode_buckets(slots, paging.decode_buckets)


def prefix_caching(paging: Optional[PagedServing], cache, max_seq_len: int) -> tuple[Optional[int], int, Optional[int]]:
    if paging is None or paging.prefix_chunk is None:
        return None, 0, None
    check_prefix_caching(paging, cache.page_size)
    kept = paging.max_prefixes
    kept = default_max_prefixes(cache, paging.prefix_chunk, max_seq_len) if kept is None else kept
    return paging.prefix_chunk, kept, prefix_bytes(paging, cache, max_seq_len)
