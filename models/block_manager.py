"""The block manager and scheduler of `kivi serve --paged`: which pages of the pool each sequence
holds, and which requests run, wait or sit swapped out. Pure Python (no torch, no model): the
engine (serve_engine.py) moves the bytes; this module only decides.

- `BlockManager`: a pool of `num_pages` page ids with a free queue and a reference count per page,
  and each sequence's page list (its block table row, logical -> physical). A sequence's pages
  are counted by the cache kind's `pages_needed(num_tokens)` (paged fp: every token; paged KIVI:
  its quantized tokens only), and are allocated as it grows and freed at once when it ends.
- `Scheduler`: vLLM's policy. Before each decode step every running sequence gets the pages its
  next token needs, oldest first; when the pool runs out, the most recently admitted running
  request is preempted (swapped out to host memory: the engine saves its pages and row state,
  then its pages return to the pool), and so on until the older one fits. A swapped request
  comes back (FCFS) before any new request is admitted, and a new request is admitted (FCFS) only
  when the pages for its prompt and its first decode step are free. The oldest running request
  always progresses, so nothing admitted fails for lack of pages and nothing starves, provided
  each request alone fits the pool (the server refuses the ones that never could, with a 400).
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Callable, Hashable, Iterable


class NoFreePages(RuntimeError):
    """allocate() was asked for more pages than are free (a scheduling bug: callers check first)."""


class BlockManager:
    """Page ids 0..num_pages-1, a free queue (FIFO), reference counts, and per sequence its page
    list. pages_needed(num_tokens) -> pages a sequence of num_tokens tokens occupies;
    max_pages_per_seq: the block table's width."""

    def __init__(self, num_pages: int, max_pages_per_seq: int, pages_needed: Callable[[int], int]):
        for name, value in (("num_pages", num_pages), ("max_pages_per_seq", max_pages_per_seq)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        self.num_pages, self.max_pages_per_seq, self.pages_needed = num_pages, max_pages_per_seq, pages_needed
        self.free_queue: collections.deque[int] = collections.deque(range(num_pages))
        self.refs = [0] * num_pages
        self.tables: dict[Hashable, list[int]] = {}

    # ---------------------------------------------------------------- counts

    @property
    def num_free(self) -> int:
        return len(self.free_queue)

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self.free_queue)

    @property
    def num_shared(self) -> int:
        """Pages held by more than one sequence (prefix sharing)."""
        return sum(r > 1 for r in self.refs)

    @property
    def max_pages(self) -> int:
        """The most pages one sequence can ever hold: the pool or the table width, the smaller."""
        return min(self.num_pages, self.max_pages_per_seq)

    def fits(self, num_tokens: int) -> bool:
        """Whether a sequence of num_tokens tokens could ever be held (alone in the pool)."""
        return self.pages_needed(num_tokens) <= self.max_pages

    def table(self, seq: Hashable) -> list[int]:
        """seq's pages in order (logical page j -> table(seq)[j]); [] for an unknown sequence."""
        return list(self.tables.get(seq, ()))

    def shortfall(self, seq: Hashable, num_tokens: int) -> int:
        """Pages seq still lacks to hold num_tokens tokens."""
        return max(0, self.pages_needed(num_tokens) - len(self.tables.get(seq, ())))

    def can_hold(self, seq: Hashable, num_tokens: int) -> bool:
        return self.shortfall(seq, num_tokens) <= self.num_free

    # ---------------------------------------------------------------- changes

    def allocate(self, seq: Hashable, num_tokens: int) -> list[int]:
        """Grow seq's pages to hold num_tokens tokens (a new sequence starts with none); returns
        the new page ids, in order. Raises NoFreePages (nothing changes) when too few are free, and
        ValueError past the table width."""
        need = self.pages_needed(num_tokens)
        if need > self.max_pages_per_seq:
            raise ValueError(f"{num_tokens} tokens need {need} pages; a sequence holds at most "
                             f"{self.max_pages_per_seq} (max_pages_per_seq)")
        short = self.shortfall(seq, num_tokens)
        if short > self.num_free:
            raise NoFreePages(f"{short} pages needed, {self.num_free} free")
        new = [self.free_queue.popleft() for _ in range(short)]
        for page in new:
            self.refs[page] = 1
        self.tables.setdefault(seq, []).extend(new)
        return new

    def free(self, seq: Hashable) -> list[int]:
        """seq ends (or is swapped out): drop one reference to each of its pages; pages no one holds
        go back to the free queue. Returns the pages seq held, in table order (a swap saves them
        first). An unknown sequence holds nothing."""
        pages = self.tables.pop(seq, [])
        for page in pages:
            self.refs[page] -= 1
            if self.refs[page] == 0:
                self.free_queue.append(page)
        return pages

    def check(self) -> None:
        """Invariants (tests): reference counts equal the tables' holdings; free pages are exactly
        those no one holds, each once."""
        counted = collections.Counter(p for pages in self.tables.values() for p in pages)
        assert all(self.refs[p] == counted.get(p, 0) for p in range(self.num_pages)), (self.refs, counted)
        assert sorted(self.free_queue) == [p for p in range(self.num_pages) if self.refs[p] == 0], self.free_queue


@dataclass
class Plan:
    """One scheduling round's decisions, to carry out in this order: save each preempted
    sequence's pages (listed here, already returned to the pool) and row state to host memory;
    load each resumed sequence into its new pages; prefill each admitted one into its pages.
    Every sequence in `running` afterwards holds the pages for its next decode step."""

    preempted: list[tuple[Hashable, list[int]]] = field(default_factory=list)
    resumed: list[Hashable] = field(default_factory=list)
    admitted: list[Hashable] = field(default_factory=list)


class Scheduler:
    """running: admitted sequences in admission order (the last is the first to be preempted);
    swapped: preempted ones, in admission order (the first comes back first). rows: how many
    sequences may run at once (the cache's batch size)."""

    def __init__(self, blocks: BlockManager, rows: int):
        self.blocks, self.rows = blocks, rows
        self.running: list[Hashable] = []
        self.swapped: list[Hashable] = []
        self.order: dict[Hashable, int] = {}  # admission number
        self.admissions = 0
        self.preemptions = 0

    def schedule(self, waiting: collections.deque, tokens: Callable[[Hashable], int]) -> Plan:
        """Decide this round. tokens(seq): the tokens seq must hold after the next decode step (for
        a waiting request: its prompt plus the first decoded token). Admitted requests are popped
        from the left of `waiting` (FCFS)."""
        plan, blocks = Plan(), self.blocks
        # 1. Running sequences grow, oldest first; the most recent ones make room.
        for seq in list(self.running):
            if seq not in self.running:
                continue  # preempted for an older one this round
            while blocks.shortfall(seq, tokens(seq)) > blocks.num_free:
                victim = self.running.pop()
                plan.preempted.append((victim, blocks.free(victim)))
                self.swapped.append(victim)
                self.preemptions += 1
                if victim is seq:
                    break
            else:
                blocks.allocate(seq, tokens(seq))
        self.swapped.sort(key=self.order.__getitem__)
        if plan.preempted:
            return plan  # the pool is short right now: bring nothing in this round
        # 2. Swapped sequences come back first (FCFS), 3. then new ones (FCFS), while rows and pages last.
        while self.swapped and len(self.running) < self.rows and blocks.can_hold(self.swapped[0], tokens(self.swapped[0])):
            seq = self.swapped.pop(0)
            blocks.allocate(seq, tokens(seq))
            self.running.append(seq)
            plan.resumed.append(seq)
        while not self.swapped and waiting and len(self.running) < self.rows and blocks.can_hold(waiting[0], tokens(waiting[0])):
            seq = waiting.popleft()
            blocks.allocate(seq, tokens(seq))
            self.order[seq] = self.admissions
            self.admissions += 1
            self.running.append(seq)
            plan.admitted.append(seq)
        self.running.sort(key=self.order.__getitem__)
        return plan

    def finish(self, seq: Hashable) -> None:
        """seq ended (done, failed, cancelled), running or swapped: its pages go back at once."""
        if seq in self.running:
            self.running.remove(seq)
        if seq in self.swapped:
            self.swapped.remove(seq)
        self.blocks.free(seq)
        self.order.pop(seq, None)

    def finish_all(self, seqs: Iterable[Hashable] = ()) -> None:
        for seq in [*self.running, *self.swapped, *seqs]:
            self.finish(seq)
