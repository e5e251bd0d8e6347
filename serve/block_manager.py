"""The block manager and scheduler of `kivi serve` (docs/serve.md, Paged): which pages each sequence holds,
which requests run, wait or are swapped out. Pure Python: it decides, the runner moves the bytes."""

from __future__ import annotations

import collections
import hashlib
from dataclasses import dataclass, field
from typing import Callable, Hashable, Iterable, Optional, Sequence


class NoFreePages(RuntimeError):
    """allocate() was asked for more pages than are free (a scheduling bug: callers check first)."""


def prefix_keys(tokens: Sequence[int], chunk: int) -> list[bytes]:
    """Keys of a prompt's prefixes of chunk, 2 * chunk, ... tokens: a SHA-256 chain, so a key names the whole prefix."""
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk <= 0:
        raise ValueError(f"chunk must be a positive int, got {chunk!r}")
    keys, key = [], b""
    for end in range(chunk, len(tokens) + 1, chunk):
        key = hashlib.sha256(key + b"|" + ",".join(map(str, tokens[end - chunk:end])).encode()).digest()
        keys.append(key)
    return keys


@dataclass(eq=False)
class CachedPrefix:

    num_tokens: int
    pages: list[int]
    payload: object = None
    nbytes: int = 0  # host bytes the payload holds (max_prefix_bytes bounds them)


class BlockManager:

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
        self.refs = [0] * num_pages
        self.cache_refs = [0] * num_pages
        self.tables: dict[Hashable, list[int]] = {}
        self.max_prefixes, self.max_prefix_bytes = max_prefixes, max_prefix_bytes
        self.prefix_bytes = 0
        self.prefixes: collections.OrderedDict[bytes, CachedPrefix] = collections.OrderedDict()  # LRU first
        self.evictions = 0
        self.on_evict: Optional[Callable[[CachedPrefix], None]] = None

    @property
    def num_free(self) -> int:
        return len(self.free_queue)

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self.free_queue)

    @property
    def num_shared(self) -> int:
        return sum(r - c > 1 for r, c in zip(self.refs, self.cache_refs))

    @property
    def num_cached(self) -> int:
        return sum(c > 0 for c in self.cache_refs)

    @property
    def num_reclaimable(self) -> int:
        """Pages only cached prefixes hold: evicting every prefix would free them."""
        return sum(c > 0 and r == c for r, c in zip(self.refs, self.cache_refs))

    @property
    def max_pages(self) -> int:
        return min(self.num_pages, self.max_pages_per_seq)

    def fits(self, num_tokens: int) -> bool:
        return self.pages_needed(num_tokens) <= self.max_pages

    def table(self, seq: Hashable) -> list[int]:
        return list(self.tables.get(seq, ()))

    def shortfall(self, seq: Hashable, num_tokens: int) -> int:
        return max(0, self.pages_needed(num_tokens) - len(self.tables.get(seq, ())))

    def allocate(self, seq: Hashable, num_tokens: int) -> list[int]:
        """Grow seq's pages to hold num_tokens tokens; the new ids. NoFreePages (no change) if too few."""
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
        """Drop seq's reference to each of its pages; the pages it held, in table order."""
        pages = self.tables.pop(seq, [])
        self._drop(pages)
        return pages

    def lookup(self, keys: Sequence[bytes]) -> Optional[CachedPrefix]:
        """The longest cached prefix among keys (shortest first), marked recently used."""
        for key in reversed(keys):
            if key in self.prefixes:
                self.prefixes.move_to_end(key)
                return self.prefixes[key]
        return None

    def share(self, seq: Hashable, prefix: CachedPrefix) -> None:
        if self.tables.get(seq):
            raise ValueError(f"share: sequence {seq!r} already holds pages")
        for page in prefix.pages:
            self.refs[page] += 1
        self.tables[seq] = list(prefix.pages)

    def cache_prefix(self, key: bytes, prefix: CachedPrefix) -> bool:
        """Keep prefix under key, evicting LRU ones past max_prefixes / max_prefix_bytes. False: not kept."""
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
        prefix = self.prefixes.pop(key) if key is not None else self.prefixes.popitem(last=False)[1]
        for page in prefix.pages:
            self.cache_refs[page] -= 1
        self._drop(prefix.pages)
        self.prefix_bytes -= prefix.nbytes
        self.evictions += 1
        if self.on_evict is not None:
            self.on_evict(prefix)

    def _reclaim_victim(self) -> Optional[bytes]:
        """The LRU prefix whose eviction frees a page; failing that, the LRU one holding a page only prefixes hold."""
        for key, prefix in self.prefixes.items():
            if any(self.refs[p] == 1 for p in prefix.pages):
                return key
        for key, prefix in self.prefixes.items():
            if any(self.refs[p] == self.cache_refs[p] for p in prefix.pages):
                return key
        return None

    def reclaim(self, pages: int) -> bool:
        """Evict LRU prefixes until `pages` pages are free, if reclaiming can make it (else none). Whether they are."""
        if self.num_free >= pages:
            return True
        if self.num_free + self.num_reclaimable < pages:
            return False
        while self.num_free < pages:
            self._evict_one(self._reclaim_victim())
        return True

    def clear_prefixes(self) -> None:
        while self.prefixes:
            self._evict_one()

    def check(self) -> None:
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

    preempted: list[tuple[Hashable, list[int]]] = field(default_factory=list)
    resumed: list[Hashable] = field(default_factory=list)
    admitted: list[Hashable] = field(default_factory=list)
    hits: dict[Hashable, CachedPrefix] = field(default_factory=dict)
    rows: dict[Hashable, int] = field(default_factory=dict)


class Scheduler:
    """rows[i]: the sequence row i serves (None: free); swapped: the preempted ones, first back first."""

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
        """This round's decisions (vLLM's policy, docs/serve.md); admitted requests leave `waiting` from the left."""
        plan, blocks = Decisions(), self.blocks
        running = self.running
        # 1. Running sequences grow, oldest first; the most recent ones make room.
        for seq in list(running):
            if seq not in running:  # preempted for an older one this round
                continue
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
        if plan.preempted:  # the pool is short right now: bring nothing in this round
            return plan
        # 2. Swapped sequences come back first, 3. then new ones (FCFS), while rows and pages last.
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
        if seq in self.rows:
            self.rows[self.rows.index(seq)] = None
        if seq in self.swapped:
            self.swapped.remove(seq)
        self.blocks.free(seq)
        self.order.pop(seq, None)
