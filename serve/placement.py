"""The scheduler of `kivi serve`: where each request sits, and each round's frozen Plan.
Only the engine thread changes it, under the engine's lock (other threads read it under that lock)."""

from __future__ import annotations

import collections
from typing import Optional

from .block_manager import BlockManager, CachedPrefix, Scheduler, prefix_keys
from .plan import Plan, Prefill, Swap
from .request import HOST_KEYS, Request, RequestError, context_error, prompt_count


class Placement:
    """layout: a paged cache or runner.RowPages; buckets: the decode step's row counts, ascending."""

    def __init__(self, layout, slots: int, buckets: tuple[int, ...], prefix_chunk: Optional[int] = None,
                 max_prefixes: int = 0, report_pages: bool = True, max_prefix_bytes: Optional[int] = None):
        self.layout, self.buckets, self.prefix_chunk = layout, buckets, prefix_chunk
        self.report_pages = report_pages
        self.blocks = BlockManager(layout.num_pages, layout.max_pages_per_seq, layout.pages_needed,
                                   max_prefixes=max_prefixes, max_prefix_bytes=max_prefix_bytes)
        # Host keys to drop once no prefill of the round needs them: evicted prefixes' tails, tails not kept.
        self.dropped: list[int] = []
        self.blocks.on_evict = lambda prefix: self.dropped.append(prefix.payload)
        self.scheduler = Scheduler(self.blocks, slots)
        self.waiting: collections.deque[Request] = collections.deque()  # FIFO, admitted by plan()
        self.table_rows: list[tuple[Optional[Request], int]] = [(None, 0)] * slots  # what the runner's table[row] holds

    @property
    def rows(self) -> list[Optional[Request]]:
        return self.scheduler.rows

    def running(self) -> list[tuple[int, Request]]:
        return [(slot, r) for slot, r in enumerate(self.rows) if r is not None]

    def requests(self) -> list[Request]:
        return [*self.waiting, *self.scheduler.swapped, *(r for _, r in self.running())]

    @property
    def swapped(self) -> list[Request]:
        return self.scheduler.swapped

    @property
    def max_prefixes(self) -> int:
        return self.blocks.max_prefixes

    @property
    def max_prefix_bytes(self) -> Optional[int]:
        return self.blocks.max_prefix_bytes

    def free_rows(self) -> int:
        return sum(r is None for r in self.rows)

    def idle(self) -> bool:
        return not self.waiting and not any(self.rows) and not self.scheduler.swapped

    def find(self, key: int) -> Optional[Request]:
        return next((r for r in self.requests() if r.key == key), None)

    def capacity_error(self, prompt_tokens: int, max_tokens: int, max_seq_len: int, *,
                       at_least: bool = False) -> Optional[RequestError]:
        """The refusal of a request that could never fit (max_seq_len, or the whole pool), else None."""
        refused = context_error(prompt_tokens, max_tokens, max_seq_len, at_least=at_least)
        if refused is not None:
            return refused
        tokens = prompt_tokens + max_tokens
        if self.blocks.fits(tokens):
            return None
        return RequestError(
            f"the prompt ({prompt_count(prompt_tokens, at_least)}) + max_tokens ({max_tokens}) needs "
            f"{self.blocks.pages_needed(tokens)} pages of {self.layout.page_size} tokens, more than the whole pool of "
            f"{self.blocks.num_pages} pages holds (--num-pages / --cache-budget-gib)", code="context_length_exceeded",
            param="max_tokens" if self.blocks.fits(prompt_tokens) else "prompt")

    def prompt_pages(self, r: Request) -> list[int]:
        return self.blocks.table(r)[:self.layout.pages_needed(len(r.prompt_ids))]

    def saved_pages(self, r: Request) -> list[int]:
        return self.blocks.table(r)[:r.saved]

    def page_stats(self) -> dict:
        return self._pool_counts() if self.report_pages else {}

    def _pool_counts(self) -> dict:
        return dict(pages_used=self.blocks.num_used, pages_free=self.blocks.num_free,
                    pages_shared=self.blocks.num_shared, preemptions=self.scheduler.preemptions,
                    swapped=len(self.scheduler.swapped))

    def prefix_stats(self) -> dict:
        return dict(pages_cached=self.blocks.num_cached, prefixes_cached=len(self.blocks.prefixes),
                    prefix_bytes=self.blocks.prefix_bytes)

    def snapshot(self) -> dict:
        held = [*(r for _, r in self.running()), *self.scheduler.swapped]
        counts = dict(self._pool_counts(), **self.prefix_stats(), num_pages=self.blocks.num_pages,
                      evictions=self.blocks.evictions)
        counts.pop("swapped", None)
        return dict(counts, rows=[None if r is None else r.id for r in self.rows], waiting=[r.id for r in self.waiting],
                    swapped=[r.id for r in self.scheduler.swapped], pages={r.id: self.blocks.table(r) for r in held})

    def plan(self) -> Plan:
        lookup = None
        if self.prefix_chunk is not None:  # a cached prefix must leave a token to prefill (its logits)
            lookup = lambda r: r.prefix_keys[:(len(r.prompt_ids) - 1) // self.prefix_chunk]  # noqa: E731
        d = self.scheduler.schedule(self.waiting, tokens_after_step, lookup)
        swap_out = []
        for r, held in d.preempted:
            self.table_rows[d.rows[r]] = (None, -1)  # it may come back here with other pages, as many
            r.preemptions += 1
            r.saved = len(held)
            swap_out.append(Swap(d.rows[r], r.key, tuple(held)))
        swap_in = [Swap(d.rows[r], r.key, tuple(self.saved_pages(r))) for r in d.resumed]
        for r in d.resumed:
            r.saved = None
        prefills = tuple(self._prefill(d.rows[r], r, d.hits.get(r)) for r in d.admitted)
        moves = self.compaction()
        table = tuple(self.table_update()) if self.report_pages else ()
        decode = ()
        if any(r is not None and r.tokens for r in self.rows):
            _, rows = self.decode_batch()
            decode = tuple(r.tokens[-1] if r is not None and r.tokens else -1 for r in self.rows[:rows])
        return Plan(tuple(swap_out), tuple(swap_in), prefills, tuple(self.take_dropped()), tuple(moves), table, decode)

    def _prefill(self, row: int, r: Request, hit: Optional[CachedPrefix]) -> Prefill:
        pages = tuple(self.prompt_pages(r))
        if self.prefix_chunk is None:
            return Prefill(row, r.key, tuple(r.prompt_ids), pages)
        start, shared, tail_key = (0, 0, -1) if hit is None else (hit.num_tokens, len(hit.pages), hit.payload)
        boundaries = tuple(self.new_boundaries(r, start))
        return Prefill(row, r.key, tuple(r.prompt_ids), pages, self.prefix_chunk, start, shared, tail_key, boundaries,
                       tuple(next(HOST_KEYS) for _ in boundaries))

    def leave(self, r: Request) -> None:
        if r in self.waiting:
            self.waiting.remove(r)
            return
        if r in self.rows:
            self.table_rows[self.rows.index(r)] = (None, -1)  # rewrite this table row before the next step
        self.scheduler.finish(r)

    def compaction(self) -> list[tuple[int, int]]:
        """Move requests at or past the bucket their number needs into free rows below it: the (from, to) moves."""
        active = [slot for slot, _ in self.running()]
        limit = self.bucket(len(active))
        free = [slot for slot in range(limit) if self.rows[slot] is None]
        moves = [(src, free.pop(0)) for src in active if src >= limit]
        for src, dst in moves:
            self.rows[dst], self.rows[src] = self.rows[src], None
            self.table_rows[src] = self.table_rows[dst] = (None, -1)
        return moves

    def table_update(self) -> list[tuple[int, tuple[int, ...]]]:
        """Block-table rows changed since the last call; (request, page count) names a row's content."""
        changed = []
        for slot, r in enumerate(self.rows):
            pages = self.blocks.tables.get(r, []) if r is not None else []
            if self.table_rows[slot] != (r, len(pages)):
                self.table_rows[slot] = (r, len(pages))
                changed.append((slot, tuple(pages)))
        return changed

    def decode_batch(self) -> tuple[list[int], int]:
        active = [slot for slot, _ in self.running()]
        return active, self.bucket(active[-1] + 1)

    def bucket(self, rows: int) -> int:
        return next(b for b in self.buckets if b >= rows)

    def submit_keys(self, r: Request) -> None:
        if self.prefix_chunk is not None:
            r.prefix_keys = prefix_keys(r.prompt_ids, self.prefix_chunk)

    def new_boundaries(self, r: Request, start: int) -> list[int]:
        chunk = self.prefix_chunk
        return [b for b in range(start + chunk, len(r.prompt_ids) + 1, chunk)
                if self.blocks.max_prefixes and r.prefix_keys[b // chunk - 1] not in self.blocks.prefixes]

    def cache_prefix(self, r: Request, boundary: int, key: int, pages_final: int, nbytes: int) -> bool:
        prefix = CachedPrefix(boundary, self.blocks.table(r)[:pages_final], key, nbytes)
        return self.blocks.cache_prefix(r.prefix_keys[boundary // self.prefix_chunk - 1], prefix)

    def take_dropped(self) -> list[int]:
        dropped, self.dropped = self.dropped, []
        return dropped

    def check(self) -> None:
        self.blocks.check()
        running = [r for _, r in self.running()]
        assert len(running) == len(set(map(id, running))), "a request holds two rows"
        assert not set(map(id, running)) & set(map(id, self.scheduler.swapped)), "a request runs and is swapped out"


def tokens_after_step(r: Request) -> int:
    """Tokens r holds after the next decode step (a waiting request: its prompt and first token)."""
    return len(r.prompt_ids) + max(len(r.tokens), 1)
