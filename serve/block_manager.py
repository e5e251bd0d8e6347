"""The block manager and scheduler of `kivi serve`: which pages of the pool each sequence holds,
and which requests run, wait or sit swapped out. Pure Python (no torch, no model): the engine
(engine.py) moves the bytes; this module only decides. A static cache is scheduled here too, as
one page of max_seq_len tokens per row (runner.RowPages): every request needs one page, so it is
admitted while a row is free and never preempted.

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
- Prefix caching (`kivi serve --paged --prefix-caching`, vLLM's automatic prefix caching): the
  manager also keeps cached prefixes, each keyed by the hash chain of the tokens it covers
  (`prefix_keys`), holding a reference to the pages that prefix made final, plus an opaque payload
  (the engine's host copy of the rest of the row state at that point). A new request that starts
  with a cached prefix takes those pages by reference (`share`). Pages that only cached prefixes
  hold are reclaimable: when the pool runs short, the least recently used prefixes whose eviction
  frees a page are evicted before any running request is preempted, so the cache never makes the
  pool run dry (and a prefix whose pages running requests hold anyway is kept).
"""

from __future__ import annotations

import collections
import hashlib
from dataclasses import dataclass, field
from typing import Callable, Hashable, Iterable, Optional, Sequence


class NoFreePages(RuntimeError):
    """allocate() was asked for more pages than are free (a scheduling bug: callers check first)."""


def prefix_keys(tokens: Sequence[int], chunk: int) -> list[bytes]:
    """The cache keys of a prompt's prefixes of chunk, 2 * chunk, ... tokens (every whole chunk):
    a SHA-256 chain, key i = H(key i-1, tokens of chunk i), so a key names the whole prefix, not
    just its last chunk (as vLLM's block hashes)."""
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk <= 0:
        raise ValueError(f"chunk must be a positive int, got {chunk!r}")
    keys, key = [], b""
    for end in range(chunk, len(tokens) + 1, chunk):
        key = hashlib.sha256(key + b"|" + ",".join(map(str, tokens[end - chunk:end])).encode()).digest()
        keys.append(key)
    return keys


@dataclass(eq=False)
class CachedPrefix:
    """A cached prefix of num_tokens tokens: the pages it made final (held by reference) and the
    engine's payload (what a request needs besides those pages to continue from there)."""

    num_tokens: int
    pages: list[int]
    payload: object = None
    nbytes: int = 0  # the host memory the payload holds (what max_prefix_bytes bounds)


class BlockManager:
    """Page ids 0..num_pages-1, a free queue (FIFO), reference counts, and per sequence its page
    list. pages_needed(num_tokens) -> pages a sequence of num_tokens tokens occupies;
    max_pages_per_seq: the block table's width. max_prefixes: the most cached prefixes kept (0:
    prefix caching off), max_prefix_bytes: the most bytes their payloads hold together (None: no
    bound); beyond either the least recently used ones are dropped."""

    def __init__(self, num_pages: int, max_pages_per_seq: int, pages_needed: Callable[[int], int],
                 max_prefixes: int = 0, max_prefix_bytes: Optional[int] = None):
        for name, value in (("num_pages", num_pages), ("max_pages_per_seq", max_pages_per_seq)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if isinstance(max_prefixes, bool) or not isinstance(max_prefixes, int) or max_prefixes < 0:
            raise ValueError(f"max_prefixes must be an int >= 0, got {max_prefixes!r}")
        if max_prefix_bytes is not None and (isinstance(max_prefix_bytes, bool) or not isinstance(max_prefix_bytes, int)
                                             or max_prefix_bytes < 0):
            raise ValueError(f"max_prefix_bytes must be an int >= 0 or None, got {max_prefix_bytes!r}")
        self.num_pages, self.max_pages_per_seq, self.pages_needed = num_pages, max_pages_per_seq, pages_needed
        self.free_queue: collections.deque[int] = collections.deque(range(num_pages))
        self.refs = [0] * num_pages  # every holder: sequences and cached prefixes
        self.cache_refs = [0] * num_pages  # cached prefixes only
        self.tables: dict[Hashable, list[int]] = {}
        self.max_prefixes, self.max_prefix_bytes = max_prefixes, max_prefix_bytes
        self.prefix_bytes = 0  # what the cached prefixes' payloads hold
        self.prefixes: collections.OrderedDict[bytes, CachedPrefix] = collections.OrderedDict()  # LRU first
        self.evictions = 0
        # Called with each evicted prefix (the engine frees its payload's host copy).
        self.on_evict: Optional[Callable[[CachedPrefix], None]] = None

    # ---------------------------------------------------------------- counts

    @property
    def num_free(self) -> int:
        return len(self.free_queue)

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self.free_queue)

    @property
    def num_shared(self) -> int:
        """Pages held by more than one sequence (prefix sharing; cached prefixes do not count)."""
        return sum(r - c > 1 for r, c in zip(self.refs, self.cache_refs))

    @property
    def num_cached(self) -> int:
        """Pages held by cached prefixes (some may be held by sequences too)."""
        return sum(c > 0 for c in self.cache_refs)

    @property
    def num_reclaimable(self) -> int:
        """Pages only cached prefixes hold: evicting every prefix would free them."""
        return sum(c > 0 and r == c for r, c in zip(self.refs, self.cache_refs))

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

    def _drop(self, pages: Iterable[int]) -> None:
        for page in pages:
            self.refs[page] -= 1
            if self.refs[page] == 0:
                self.free_queue.append(page)

    def free(self, seq: Hashable) -> list[int]:
        """seq ends (or is swapped out): drop one reference to each of its pages; pages no one holds
        go back to the free queue. Returns the pages seq held, in table order (a swap saves them
        first). An unknown sequence holds nothing."""
        pages = self.tables.pop(seq, [])
        self._drop(pages)
        return pages

    # ---------------------------------------------------------------- prefix cache

    def lookup(self, keys: Sequence[bytes]) -> Optional[CachedPrefix]:
        """The longest cached prefix among keys (a prompt's prefix_keys, shortest first), marked
        recently used; None when none is cached."""
        for key in reversed(keys):
            if key in self.prefixes:
                self.prefixes.move_to_end(key)
                return self.prefixes[key]
        return None

    def share(self, seq: Hashable, prefix: CachedPrefix) -> None:
        """A new sequence (holding nothing yet) starts with prefix's pages, by reference."""
        if self.tables.get(seq):
            raise ValueError(f"share: sequence {seq!r} already holds pages")
        for page in prefix.pages:
            self.refs[page] += 1
        self.tables[seq] = list(prefix.pages)

    def cache_prefix(self, key: bytes, prefix: CachedPrefix) -> bool:
        """Keep prefix under key (its pages gain a reference each); the least recently used prefix
        goes while more than max_prefixes, or more than max_prefix_bytes, would be kept. False
        (nothing changes) when key is already cached, caching is off, or the prefix alone exceeds
        max_prefix_bytes."""
        too_big = self.max_prefix_bytes is not None and prefix.nbytes > self.max_prefix_bytes
        if self.max_prefixes == 0 or key in self.prefixes or too_big:
            return False
        if not all(0 <= p < self.num_pages and self.refs[p] > 0 for p in prefix.pages):
            raise ValueError(f"cache_prefix: pages {prefix.pages} must be held by a sequence already")
        for page in prefix.pages:
            self.refs[page] += 1
            self.cache_refs[page] += 1
        self.prefixes[key] = prefix
        self.prefix_bytes += prefix.nbytes
        while len(self.prefixes) > self.max_prefixes or self._over_bytes():
            self._evict_one()
        return True

    def _over_bytes(self) -> bool:
        return self.max_prefix_bytes is not None and self.prefix_bytes > self.max_prefix_bytes

    def _evict_one(self, key: Optional[bytes] = None) -> None:
        """Evict the prefix under key (None: the least recently used one)."""
        prefix = self.prefixes.pop(key) if key is not None else self.prefixes.popitem(last=False)[1]
        for page in prefix.pages:
            self.cache_refs[page] -= 1
        self._drop(prefix.pages)
        self.prefix_bytes -= prefix.nbytes
        self.evictions += 1
        if self.on_evict is not None:
            self.on_evict(prefix)

    def _reclaim_victim(self) -> Optional[bytes]:
        """The prefix reclaim() evicts next: the least recently used one whose eviction frees a page
        (it alone holds it); evicting one whose pages running sequences or other prefixes still
        hold would throw a useful prefix away for nothing. Failing that (pages several prefixes
        alone hold, e.g. two prefixes on the same pages), the least recently used one holding such
        a page: they come free once all of those go. None: nothing is reclaimable."""
        for key, prefix in self.prefixes.items():  # least recently used first
            if any(self.refs[p] == 1 for p in prefix.pages):
                return key
        for key, prefix in self.prefixes.items():
            if any(self.refs[p] == self.cache_refs[p] for p in prefix.pages):
                return key
        return None

    def reclaim(self, pages: int) -> bool:
        """Evict least recently used prefixes, skipping those whose eviction frees no page, until
        `pages` pages are free, if the pages only prefixes hold can make it (else evict nothing).
        Returns whether that many are free."""
        if self.num_free >= pages:
            return True
        if self.num_free + self.num_reclaimable < pages:
            return False
        # Each eviction of a victim turns reclaimable pages into free ones (or brings them closer),
        # and no other page becomes reclaimable or stops being so: the goal above is met.
        while self.num_free < pages:
            self._evict_one(self._reclaim_victim())
        return True

    def clear_prefixes(self) -> None:
        while self.prefixes:
            self._evict_one()

    def check(self) -> None:
        """Invariants (tests): reference counts equal the tables' and the cached prefixes' holdings;
        free pages are exactly those no one holds, each once; at most max_prefixes are cached,
        holding at most max_prefix_bytes."""
        counted = collections.Counter(p for pages in self.tables.values() for p in pages)
        cached = collections.Counter(p for prefix in self.prefixes.values() for p in prefix.pages)
        assert all(self.cache_refs[p] == cached.get(p, 0) for p in range(self.num_pages)), (self.cache_refs, cached)
        assert all(self.refs[p] == counted.get(p, 0) + cached.get(p, 0)
                   for p in range(self.num_pages)), (self.refs, counted, cached)
        assert len(self.prefixes) <= self.max_prefixes, len(self.prefixes)
        assert self.prefix_bytes == sum(p.nbytes for p in self.prefixes.values()) and not self._over_bytes(), (
            self.prefix_bytes, self.max_prefix_bytes)
        assert sorted(self.free_queue) == [p for p in range(self.num_pages) if self.refs[p] == 0], self.free_queue


@dataclass
class Decisions:
    """One scheduling round's decisions (the engine's Plan is made of them, placement.py): the
    preempted sequences with the pages they held (already back in the pool), the resumed and the
    admitted ones, the row each of those takes or left, and the admitted ones that share a cached
    prefix. Every running sequence holds the pages for its next decode step afterwards."""

    preempted: list[tuple[Hashable, list[int]]] = field(default_factory=list)
    resumed: list[Hashable] = field(default_factory=list)
    admitted: list[Hashable] = field(default_factory=list)
    hits: dict[Hashable, CachedPrefix] = field(default_factory=dict)
    rows: dict[Hashable, int] = field(default_factory=dict)


class Scheduler:
    """Who runs and who is swapped out, each stored once: rows[i] is the sequence row i serves (None:
    free); running is derived from it in admission order (the last is the first to be preempted);
    swapped holds the preempted ones in admission order (the first comes back first). rows: how
    many sequences may run at once (the cache's batch size)."""

    def __init__(self, blocks: BlockManager, rows: int):
        self.blocks = blocks
        self.rows: list[Optional[Hashable]] = [None] * rows
        self.swapped: list[Hashable] = []
        self.order: dict[Hashable, int] = {}  # admission number
        self.admissions = 0
        self.preemptions = 0

    @property
    def running(self) -> list[Hashable]:
        return sorted((s for s in self.rows if s is not None), key=lambda s: self.order.get(s, -1))

    def _seat(self, seq: Hashable, plan: Decisions) -> None:
        plan.rows[seq] = row = self.rows.index(None)
        self.rows[row] = seq

    def schedule(self, waiting: collections.deque, tokens: Callable[[Hashable], int],
                 prefix_keys: Optional[Callable[[Hashable], Sequence[bytes]]] = None) -> Decisions:
        """Decide this round. tokens(seq): the tokens seq must hold after the next decode step (for
        a waiting request: its prompt plus the first decoded token). Admitted requests are popped
        from the left of `waiting` (FCFS). prefix_keys(seq) (prefix caching): the keys of the
        prefixes a waiting sequence may take from the cache; an admitted one that finds one shares
        its pages (plan.hits). Pages only cached prefixes hold are evicted (least recently used
        first) before anything is preempted or refused."""
        plan, blocks = Decisions(), self.blocks
        running = self.running
        # 1. Running sequences grow, oldest first; the most recent ones make room.
        for seq in list(running):
            if seq not in running:
                continue  # preempted for an older one this round
            while not blocks.reclaim(blocks.shortfall(seq, tokens(seq))):
                victim = running.pop()
                plan.rows[victim] = row = self.rows.index(victim)
                self.rows[row] = None
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
        while (self.swapped and None in self.rows
               and blocks.reclaim(blocks.shortfall(self.swapped[0], tokens(self.swapped[0])))):
            seq = self.swapped.pop(0)
            blocks.allocate(seq, tokens(seq))
            self._seat(seq, plan)
            plan.resumed.append(seq)
        while not self.swapped and waiting and None in self.rows:
            seq = waiting[0]
            hit = blocks.lookup(prefix_keys(seq)) if prefix_keys is not None else None
            if hit is not None:
                blocks.share(seq, hit)  # first, so that making room cannot evict the pages it takes
            if not blocks.reclaim(blocks.shortfall(seq, tokens(seq))):
                blocks.free(seq)  # undo the share: it waits at the head of the queue
                break
            if hit is not None:
                plan.hits[seq] = hit
            waiting.popleft()
            blocks.allocate(seq, tokens(seq))
            self.order[seq] = self.admissions
            self.admissions += 1
            self._seat(seq, plan)
            plan.admitted.append(seq)
        return plan

    def finish(self, seq: Hashable) -> None:
        """seq ended (done, failed, cancelled), running or swapped: its row and pages go back at once."""
        if seq in self.rows:
            self.rows[self.rows.index(seq)] = None
        if seq in self.swapped:
            self.swapped.remove(seq)
        self.blocks.free(seq)
        self.order.pop(seq, None)
