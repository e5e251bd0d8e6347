"""The scheduler of `kivi serve`: where each request sits, and each round's plan.

A `Placement` holds the queue of waiting requests and the block manager's page scheduler
(block_manager.py: the rows, who is swapped out, pages, preemption, cached prefixes). Each engine
round it makes one frozen `Plan` (plan.py): swaps, prefills, the moves that keep the requests in
the lowest rows, the block-table rows that changed, and the decode step over the smallest bucket;
the executor's update (executor.py) tells it what became of them. It decides only: the runner
(runner.py) moves the bytes. A static cache is placed as one page of max_seq_len tokens per row
(runner.RowPages: admitted while a row is free, never preempted).

Not thread-safe: the engine calls it under its own lock.
"""

from __future__ import annotations

import collections
from typing import Optional

from .block_manager import BlockManager, CachedPrefix, Scheduler, prefix_keys
from .plan import Plan, Prefill, Swap
from .request import HOST_KEYS, Request, RequestError, context_error, prompt_count


class Placement:
    """layout: the pages the cache offers (a paged cache, or runner.RowPages); slots: its rows;
    buckets: the row counts a decode step may run over (ascending, the last is slots);
    prefix_chunk / max_prefixes / max_prefix_bytes: --prefix-caching's chunk (None: off), how many
    prefixes it keeps and the host bytes their tails may hold (None: no bound);
    report_pages: page_stats() reports the pool (a static cache's pages are its rows: the engine's
    slot counts say it, and /metrics shows no page counts for it)."""

    def __init__(self, layout, slots: int, buckets: tuple[int, ...], prefix_chunk: Optional[int] = None,
                 max_prefixes: int = 0, report_pages: bool = True, max_prefix_bytes: Optional[int] = None):
        self.layout, self.buckets, self.prefix_chunk = layout, buckets, prefix_chunk
        self.report_pages = report_pages
        self.blocks = BlockManager(layout.num_pages, layout.max_pages_per_seq, layout.pages_needed,
                                   max_prefixes=max_prefixes, max_prefix_bytes=max_prefix_bytes)
        # Host keys to drop once no prefill of the round needs them (take_dropped): the tails of evicted
        # prefixes (a request admitted this round may still start from one) and tails not kept.
        self.dropped: list[int] = []
        self.blocks.on_evict = lambda prefix: self.dropped.append(prefix.payload)
        self.scheduler = Scheduler(self.blocks, slots)
        self.waiting: collections.deque[Request] = collections.deque()  # FIFO, admitted by plan()
        self.table_rows: list[tuple[Optional[Request], int]] = [(None, 0)] * slots  # what the runner's table[row] holds

    @property
    def rows(self) -> list[Optional[Request]]:
        """The request each row serves (None: free): the scheduler's, stored once."""
        return self.scheduler.rows

    # ---------------------------------------------------------------- what is where

    def running(self) -> list[tuple[int, Request]]:
        return [(slot, r) for slot, r in enumerate(self.rows) if r is not None]

    def requests(self) -> list[Request]:
        """Every request not ended: waiting, swapped out or running."""
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
        """Nothing waits, runs or is swapped out."""
        return not self.waiting and not any(self.rows) and not self.scheduler.swapped

    def find(self, key: int) -> Optional[Request]:
        """The open request whose host key is `key`, else None (it ended)."""
        return next((r for r in self.requests() if r.key == key), None)

    def capacity_error(self, prompt_tokens: int, max_tokens: int, max_seq_len: int, *,
                       at_least: bool = False) -> Optional[RequestError]:
        """The refusal of a request that could never fit: beyond a sequence's max_seq_len, or
        needing more pages than the whole pool holds. at_least: prompt_tokens is a lower bound."""
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
        """The pages r's prompt fills (the first of those r holds)."""
        return self.blocks.table(r)[:self.layout.pages_needed(len(r.prompt_ids))]

    def saved_pages(self, r: Request) -> list[int]:
        """The pages a resumed request's saved state goes back into."""
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
        """Who sits where, for tests and debugging: each row's request id (None: free), the
        swapped-out ids, each request's pages, and the pool's counts."""
        held = [*(r for _, r in self.running()), *self.scheduler.swapped]
        counts = dict(self._pool_counts(), **self.prefix_stats(), num_pages=self.blocks.num_pages,
                      evictions=self.blocks.evictions)
        counts.pop("swapped", None)  # the ids below say it
        return dict(counts, rows=[None if r is None else r.id for r in self.rows], waiting=[r.id for r in self.waiting],
                    swapped=[r.id for r in self.scheduler.swapped], pages={r.id: self.blocks.table(r) for r in held})

    # ---------------------------------------------------------------- decisions

    def plan(self) -> Plan:
        """This round: preempted requests leave their rows, resumed and admitted ones (from the front
        of the queue) take the lowest free rows (block_manager.Scheduler); the requests are moved into
        the lowest rows of the bucket their number needs; the running ones that have a token decode."""
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
        """r's prefill (--prefix-caching: from its cached prefix, keeping a tail at each chunk
        boundary not cached yet, under new host keys)."""
        pages = tuple(self.prompt_pages(r))
        if self.prefix_chunk is None:
            return Prefill(row, r.key, tuple(r.prompt_ids), pages)
        start, shared, tail_key = (0, 0, -1) if hit is None else (hit.num_tokens, len(hit.pages), hit.payload)
        boundaries = tuple(self.new_boundaries(r, start))
        return Prefill(row, r.key, tuple(r.prompt_ids), pages, self.prefix_chunk, start, shared, tail_key, boundaries,
                       tuple(next(HOST_KEYS) for _ in boundaries))

    def leave(self, r: Request) -> None:
        """r ends (finished, failed, cancelled), wherever it is: it leaves the queue, or its row and
        its pages, which go back to the pool."""
        if r in self.waiting:
            self.waiting.remove(r)
            return
        if r in self.rows:
            self.table_rows[self.rows.index(r)] = (None, -1)  # rewrite this table row before the next step
        self.scheduler.finish(r)

    def compaction(self) -> list[tuple[int, int]]:
        """Keep the requests in the lowest rows: move those at or past the bucket their number
        needs into free rows below it, so that the step runs over that bucket only. Returns the
        (from, to) row moves; the runner copies each row's state (not its pages)."""
        active = [slot for slot, _ in self.running()]
        limit = self.bucket(len(active))
        free = [slot for slot in range(limit) if self.rows[slot] is None]
        moves = [(src, free.pop(0)) for src in active if src >= limit]
        for src, dst in moves:
            self.rows[dst], self.rows[src] = self.rows[src], None
            self.table_rows[src] = self.table_rows[dst] = (None, -1)
        return moves

    def table_update(self) -> list[tuple[int, tuple[int, ...]]]:
        """The block-table rows whose pages changed since the last call: (row, its pages). A
        request's pages only grow while it holds its row, so (request, page count) names a row's
        content; leaving a row (release, preemption, a move) marks it for a rewrite."""
        changed = []
        for slot, r in enumerate(self.rows):
            pages = self.blocks.tables.get(r, []) if r is not None else []
            if self.table_rows[slot] != (r, len(pages)):
                self.table_rows[slot] = (r, len(pages))
                changed.append((slot, tuple(pages)))
        return changed

    def decode_batch(self) -> tuple[list[int], int]:
        """(the rows that hold a request, the bucket the decode step runs over)."""
        active = [slot for slot, _ in self.running()]
        return active, self.bucket(active[-1] + 1)

    def bucket(self, rows: int) -> int:
        """The smallest decode bucket of at least `rows` rows."""
        return next(b for b in self.buckets if b >= rows)

    # ---------------------------------------------------------------- prefix caching

    def submit_keys(self, r: Request) -> None:
        """--prefix-caching: the keys of r's prompt's chunk boundaries, computed once at submit()."""
        if self.prefix_chunk is not None:
            r.prefix_keys = prefix_keys(r.prompt_ids, self.prefix_chunk)

    def new_boundaries(self, r: Request, start: int) -> list[int]:
        """The chunk boundaries of r's prompt past `start` tokens whose prefixes are not cached yet."""
        chunk = self.prefix_chunk
        return [b for b in range(start + chunk, len(r.prompt_ids) + 1, chunk)
                if self.blocks.max_prefixes and r.prefix_keys[b // chunk - 1] not in self.blocks.prefixes]

    def cache_prefix(self, r: Request, boundary: int, key: int, pages_final: int, nbytes: int) -> bool:
        """Cache r's prefix of `boundary` tokens: the first pages_final pages r holds, and the tail
        of nbytes bytes the runner keeps under `key`. False: not kept (the caller drops the tail)."""
        prefix = CachedPrefix(boundary, self.blocks.table(r)[:pages_final], key, nbytes)
        return self.blocks.cache_prefix(r.prefix_keys[boundary // self.prefix_chunk - 1], prefix)

    def take_dropped(self) -> list[int]:
        """The host keys to drop since the last call (evicted prefixes' tails, tails not kept)."""
        dropped, self.dropped = self.dropped, []
        return dropped

    def check(self) -> None:
        """Invariants (tests): the block manager's, and every running request holding one row."""
        self.blocks.check()
        running = [r for _, r in self.running()]
        assert len(running) == len(set(map(id, running))), "a request holds two rows"
        assert not set(map(id, running)) & set(map(id, self.scheduler.swapped)), "a request runs and is swapped out"


def tokens_after_step(r: Request) -> int:
    """Tokens r's sequence holds after the next decode step: its prompt and every sampled token
    (the last one is appended by that step); a waiting request's prompt plus its first token."""
    return len(r.prompt_ids) + max(len(r.tokens), 1)
