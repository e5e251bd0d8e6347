"""`kivi serve --paged`'s options (PagedServing) and their defaults: the decode buckets a paged
engine compiles, and how many prefixes --prefix-caching keeps."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from kivi_models.generate import MAX_COMPILED_SHAPES
from kivi_ops.cache.paged_io import sequence_bytes

def check_prefix_caching(paging: "PagedServing", page_size: int) -> None:
    """Refuse a prefix chunk that is not a positive multiple of the page size, a negative prefix
    cache size, or a byte bound that is not a positive int (the CLI asks before tensor
    parallelism's ranks start waiting on each other)."""
    chunk, kept, nbytes = paging.prefix_chunk, paging.max_prefixes, paging.max_prefix_bytes
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk <= 0 or chunk % page_size:
        raise ValueError(f"--prefix-chunk must be a positive multiple of the page size ({page_size} tokens, "
                         f"--page-size), got {chunk!r}")
    if kept is not None and (isinstance(kept, bool) or not isinstance(kept, int) or kept < 0):
        raise ValueError(f"--prefix-cache-size must be an int >= 0, got {kept!r}")
    if nbytes is not None and (isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes <= 0):
        raise ValueError(f"--prefix-cache-gib must be a positive number of bytes, got {nbytes!r}")


# --prefix-cache-size's default: as many cached prefixes as this much host memory holds (each keeps
# a host copy of its tail: at the Llama-2-7B shape, KIVI-2 G=32 R=128, up to 80 MB, so 53 of them),
# and at most DEFAULT_MAX_PREFIXES (small models: 256 tails of a few MB).
PREFIX_HOST_BYTES = 4 * 2**30
DEFAULT_MAX_PREFIXES = 256


def tail_pages(cache, num_tokens: int) -> int:
    """The pages of a prefix of num_tokens tokens that are not final, whose host copy its cached tail keeps."""
    return cache.pages_needed(num_tokens) - cache.pages_final(num_tokens)


def largest_tail_bytes(cache, chunk: int, max_seq_len: int) -> int:
    """The host bytes of the largest tail a prefix of this paged cache can have (at any chunk
    boundary up to max_seq_len)."""
    largest = max((tail_pages(cache, b) for b in range(chunk, max_seq_len + 1, chunk)),
                  default=0)  # a chunk longer than any sequence: no prefix is ever cached
    return sequence_bytes(cache, largest)


def default_max_prefixes(cache, chunk: int, max_seq_len: int) -> int:
    """How many cached prefixes PREFIX_HOST_BYTES holds at the largest tail, between 1 and
    DEFAULT_MAX_PREFIXES. Under tensor parallelism each rank holds its own heads' tails: the budget
    is per rank."""
    return max(1, min(DEFAULT_MAX_PREFIXES, PREFIX_HOST_BYTES // largest_tail_bytes(cache, chunk, max_seq_len)))


def prefix_bytes(paging: "PagedServing", cache, max_seq_len: int) -> int:
    """--prefix-cache-gib in bytes, checked to hold the largest tail (a smaller bound would keep
    some prefixes never, silently); by default as many bytes as the cache itself holds (the tails
    then never take more memory than the cache they serve), and at least the largest tail."""
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
    """`kivi serve --paged`: a pool of num_pages pages of page_size tokens (None: the cache kind's
    default) per layer instead of a static row of max_seq_len tokens per request. prefix_chunk
    (`--prefix-caching`): prompts are prefilled in chunks of that many tokens (a multiple of the
    page size) and the prefixes at chunk boundaries are cached and shared (prefix_cache.py); at
    most max_prefixes of them are kept (each holds a host copy of its tail; None: as many as
    PREFIX_HOST_BYTES holds, default_max_prefixes; 0: the same chunked prefill without any
    sharing, what sharing is tested against), whose tails hold max_prefix_bytes at most (None: as
    many as the cache, prefix_bytes). prefix_chunk None: off."""

    num_pages: int
    page_size: Optional[int] = None
    prefix_chunk: Optional[int] = None
    max_prefixes: Optional[int] = None
    decode_buckets: Optional[tuple[int, ...]] = None  # row counts a decode step may run over (decode_buckets())
    max_prefix_bytes: Optional[int] = None


SMALLEST_BUCKET = 8
# The default's most buckets: each is a graph compiled at warm-up (seconds each on CPU), which
# /health waits for. --decode-buckets may ask for up to MAX_COMPILED_SHAPES (the shapes one
# compiled decode step builds; past them a step would run eagerly).
DEFAULT_MAX_BUCKETS = 8


def decode_buckets(rows: int, chosen: Optional[tuple[int, ...]] = None) -> tuple[int, ...]:
    """The row counts a paged engine's decode step runs over (each compiled once): `chosen`
    (`--decode-buckets`), else the largest powers of two from SMALLEST_BUCKET below `rows`,
    DEFAULT_MAX_BUCKETS - 1 at most; and `rows`. Requests are kept in the lowest rows, so a step
    runs over the smallest bucket that holds them: an idle row costs a step nothing, at the price
    of one graph per bucket (vLLM captures a CUDA graph per batch size the same way)."""
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
    """The decode buckets of an engine: decode_buckets with --paged; a static cache's step runs
    over every row, (slots,)."""
    return (slots,) if paging is None else decode_buckets(slots, paging.decode_buckets)


def prefix_caching(paging: Optional[PagedServing], cache, max_seq_len: int) -> tuple[Optional[int], int, Optional[int]]:
    """(the prefix chunk, how many prefixes are kept, the bytes their tails may hold) of an engine:
    (None, 0, None) without --prefix-caching; else the checked options, defaults resolved
    (default_max_prefixes, prefix_bytes)."""
    if paging is None or paging.prefix_chunk is None:
        return None, 0, None
    check_prefix_caching(paging, cache.page_size)
    kept = paging.max_prefixes
    kept = default_max_prefixes(cache, paging.prefix_chunk, max_seq_len) if kept is None else kept
    return paging.prefix_chunk, kept, prefix_bytes(paging, cache, max_seq_len)
