"""The block manager and scheduler of `kivi serve --paged` (kivi_serve/block_manager.py), without a
model: allocation, freeing, reference counts, preemption order, FCFS resumption, no starvation, and
prefix caching (keys, shared pages, least-recently-used eviction before preemption)."""

from __future__ import annotations

import collections
import random

import pytest

from kivi_serve.block_manager import BlockManager, CachedPrefix, NoFreePages, Scheduler, prefix_keys

PS = 4


def pages(n: int) -> int:
    return -(-n // PS)


def manager(num_pages=8, width=6) -> BlockManager:
    return BlockManager(num_pages, width, pages)


def test_allocate_grows_a_table_and_free_returns_every_page():
    b = manager()
    assert b.allocate("a", 5) == [0, 1] and b.table("a") == [0, 1]
    assert b.allocate("a", 8) == [] and b.allocate("a", 9) == [2]  # grows only when a page fills
    assert b.allocate("b", 1) == [3]
    assert (b.num_used, b.num_free, b.num_shared) == (4, 4, 0)
    assert b.free("a") == [0, 1, 2] and b.num_free == 7
    assert b.allocate("c", 12) == [4, 5, 6]  # the free queue is FIFO: freed pages go to the back
    b.check()
    assert b.free("unknown") == []


def test_limits_name_themselves_and_change_nothing():
    b = manager(num_pages=8, width=6)
    with pytest.raises(ValueError, match="max_pages_per_seq"):
        b.allocate("a", 25)  # 7 pages > the table width
    b.allocate("a", 24)
    with pytest.raises(NoFreePages, match="3 pages needed, 2 free"):
        b.allocate("b", 12)
    assert b.table("b") == [] and b.num_free == 2
    assert b.fits(24) and not b.fits(25) and b.max_pages == 6
    assert not manager(num_pages=3, width=6).fits(13)  # the pool, not the table, is the limit there
    for bad in (0, -1, True, 2.0):
        with pytest.raises(ValueError, match="num_pages"):
            BlockManager(bad, 4, pages)
    b.check()


def test_reference_counts_keep_a_shared_page_until_its_last_holder_frees_it():
    b = manager()
    b.allocate("a", 8)
    b.tables["b"] = b.table("a")[:1]  # what prefix sharing does: b holds a's first page too
    b.refs[b.tables["b"][0]] += 1
    assert b.num_shared == 1
    b.check()
    assert b.free("a") == [0, 1] and b.num_free == 7  # page 0 is still held by b
    assert b.free("b") == [0] and b.num_free == 8
    b.check()


class Seq:
    """A request as the scheduler sees it: tokens held after the next decode step."""

    def __init__(self, name, prompt, max_tokens):
        self.name, self.prompt, self.max_tokens, self.generated = name, prompt, max_tokens, 0

    def tokens(self):
        return self.prompt + max(self.generated, 1)

    def __repr__(self):
        return self.name


def simulate(num_pages, rows, seqs, width=64, max_rounds=10_000, arrivals=None):
    """Run the scheduler like the engine: each round schedule, then every running sequence decodes
    one token; finished ones leave. arrivals: {name: round it arrives} (default 0). Returns the
    event log and the scheduler."""
    blocks = BlockManager(num_pages, width, pages)
    sched = Scheduler(blocks, rows)
    arrivals = arrivals or {}
    later = [s for s in seqs if arrivals.get(s.name, 0) > 0]
    waiting = collections.deque(s for s in seqs if s not in later)
    log = []
    for round_ in range(max_rounds):
        for s in [s for s in later if arrivals[s.name] == round_]:
            waiting.append(s)
            later.remove(s)
        if not (waiting or sched.running or sched.swapped or later):
            break
        plan = sched.schedule(waiting, Seq.tokens)
        log += [("preempt", s.name) for s, _ in plan.preempted]
        log += [("resume", s.name) for s in plan.resumed] + [("admit", s.name) for s in plan.admitted]
        for s in sched.running:  # every running sequence holds the pages its next token needs
            assert len(blocks.table(s)) >= pages(s.tokens()), (s, blocks.table(s))
        assert len(sched.running) <= rows
        blocks.check()
        for s in list(sched.running):
            s.generated += 1
            if s.generated >= s.max_tokens:
                sched.finish(s)
                log.append(("done", s.name))
    else:
        raise AssertionError(f"did not finish: {log[-20:]}")
    assert blocks.num_free == num_pages
    return log, sched


def test_the_most_recent_request_is_preempted_and_comes_back_before_new_admissions():
    # 6 pages of 4 tokens. a (prompt 7) and b (prompt 7) hold 2 pages each; c (prompt 3) holds 1.
    # As they grow, the pool runs out: c (the most recent) goes first, then b if a still lacks room.
    a, b, c, d = Seq("a", 7, 12), Seq("b", 7, 6), Seq("c", 3, 10), Seq("d", 2, 2)
    log, sched = simulate(6, 4, [a, b, c, d], arrivals={"d": 3})  # d arrives once the pool is full
    assert log.index(("preempt", "c")) < log.index(("done", "b"))
    first_preempted = [e for e in log if e[0] == "preempt"][0]
    assert first_preempted == ("preempt", "c")
    # d (waiting) is not admitted while c is swapped out: c resumes first.
    assert log.index(("resume", "c")) < log.index(("admit", "d"))
    assert sched.preemptions >= 1


def test_the_oldest_request_always_progresses_even_if_it_must_preempt_everyone():
    a, b, c = Seq("a", 4, 16), Seq("b", 4, 3), Seq("c", 4, 3)
    log, _ = simulate(5, 3, [a, b, c])  # a alone needs all 5 pages by its end
    assert ("preempt", "a") not in log
    assert [e for e in log if e[0] == "done"][-1] in (("done", "a"), ("done", "b"), ("done", "c"))


def test_a_request_that_alone_needs_the_whole_pool_preempts_itself_only_when_it_is_the_newest():
    # b arrives second and grows faster than a: b, the newest, is preempted, never a.
    a, b = Seq("a", 4, 10), Seq("b", 12, 10)
    log, _ = simulate(6, 2, [a, b])
    assert ("preempt", "a") not in log and ("preempt", "b") in log


def test_fcfs_admission_head_of_line_blocks_smaller_requests_behind_it():
    # big needs 4 free pages; small ones behind it must not overtake it (no starvation of big).
    hog, big, small = Seq("hog", 12, 6), Seq("big", 15, 2), Seq("small", 1, 2)
    log, _ = simulate(6, 4, [hog, big, small])
    assert log.index(("admit", "big")) < log.index(("admit", "small"))


def test_a_random_workload_finishes_with_the_pool_intact_and_every_request_done():
    rng = random.Random(0)
    for trial in range(20):
        seqs = [Seq(f"s{i}", rng.randint(1, 20), rng.randint(1, 20)) for i in range(rng.randint(1, 12))]
        num_pages = max(pages(s.prompt + s.max_tokens) for s in seqs) + rng.randint(0, 6)
        log, _ = simulate(num_pages, rng.randint(1, 6), seqs)
        assert sorted(e[1] for e in log if e[0] == "done") == sorted(s.name for s in seqs), trial
        admitted = [e[1] for e in log if e[0] == "admit"]
        assert admitted == [s.name for s in seqs], "admission is FCFS"


def test_finish_of_a_swapped_request_forgets_it():
    blocks = manager(num_pages=3)
    sched = Scheduler(blocks, 2)
    a, b = Seq("a", 4, 9), Seq("b", 4, 9)
    sched.schedule(collections.deque([a, b]), Seq.tokens)  # a: 2 pages, b: 1 page? b needs 2: waits
    assert sched.running == [a]
    a.generated = 8
    sched.finish(a)
    q = collections.deque([b])
    sched.schedule(q, Seq.tokens)
    assert sched.running == [b] and not q
    sched.finish(b)
    sched.finish(b)  # twice is harmless
    assert blocks.num_free == 3 and not sched.swapped


# ---------------------------------------------------------------- prefix caching


def test_prefix_keys_name_the_whole_prefix_and_only_whole_chunks():
    a = prefix_keys([1, 2, 3, 4, 5, 6, 7, 8, 9], 4)
    assert len(a) == 2  # 4 and 8 tokens; the 9th is no whole chunk
    assert prefix_keys([1, 2, 3, 4, 5, 6, 7, 8], 4) == a
    b = prefix_keys([0, 2, 3, 4, 5, 6, 7, 8], 4)
    assert b[0] != a[0] and b[1] != a[1]  # a change in chunk 1 changes every later key (a chain)
    assert prefix_keys([12, 34], 4) == [] and prefix_keys([1, 23], 1) != prefix_keys([12, 3], 1)
    with pytest.raises(ValueError, match="chunk must be a positive int"):
        prefix_keys([1], 0)


def test_a_cached_prefix_keeps_its_pages_until_evicted_and_sequences_share_them_by_reference():
    b = BlockManager(8, 6, pages, max_prefixes=2)
    b.allocate("a", 12)  # pages 0, 1, 2
    assert b.cache_prefix(b"k8", CachedPrefix(8, b.table("a")[:2], payload="tail"))
    assert not b.cache_prefix(b"k8", CachedPrefix(8, [2]))  # cached already: nothing changes
    assert b.num_cached == 2 and b.num_shared == 0 and b.num_reclaimable == 0  # a holds them too
    b.check()
    b.free("a")
    assert b.num_free == 6 and b.num_reclaimable == 2  # held by the cache alone
    hit = b.lookup([b"k4", b"k8", b"k12"])
    assert hit is not None and hit.num_tokens == 8 and hit.payload == "tail"
    b.share("x", hit)
    b.share("y", hit)
    b.allocate("x", 16)
    assert b.table("x")[:2] == [0, 1] and len(b.table("x")) == 4
    assert b.num_shared == 2 and b.num_reclaimable == 0
    b.check()
    with pytest.raises(ValueError, match="already holds pages"):
        b.share("x", hit)
    b.clear_prefixes()  # the sequences keep the pages
    assert b.refs[0] == 2 and b.num_cached == 0
    b.free("x")
    b.free("y")
    assert b.num_free == 8 and b.evictions == 1
    b.check()


def test_the_least_recently_used_prefix_goes_beyond_max_prefixes():
    b = BlockManager(8, 6, pages, max_prefixes=2)
    b.allocate("a", 12)
    for key, n in ((b"1", 1), (b"2", 2), (b"3", 3)):
        if key == b"3":
            assert b.lookup([b"1"]) is not None  # 1 used again: 2 is now the oldest
        b.cache_prefix(key, CachedPrefix(4 * n, b.table("a")[:n]))
    assert list(b.prefixes) == [b"1", b"3"] and b.evictions == 1
    b.check()
    with pytest.raises(ValueError, match="must be held by a sequence"):
        b.cache_prefix(b"4", CachedPrefix(4, [7]))
    assert not BlockManager(8, 6, pages).cache_prefix(b"1", CachedPrefix(4, [0]))  # caching off
    with pytest.raises(ValueError, match="max_prefixes must be an int >= 0"):
        BlockManager(8, 6, pages, max_prefixes=-1)


def test_the_least_recently_used_prefixes_go_beyond_max_prefix_bytes():
    b = BlockManager(8, 6, pages, max_prefixes=100, max_prefix_bytes=100)
    b.allocate("a", 12)
    for key, n in ((b"1", 1), (b"2", 2), (b"3", 3)):
        assert b.cache_prefix(key, CachedPrefix(4 * n, b.table("a")[:n], nbytes=40))
        b.check()
    assert list(b.prefixes) == [b"2", b"3"] and b.prefix_bytes == 80 and b.evictions == 1
    assert b.cache_prefix(b"4", CachedPrefix(4, b.table("a")[:1], nbytes=60))  # 140 bytes: 2 goes
    assert list(b.prefixes) == [b"3", b"4"] and b.prefix_bytes == 100
    assert not b.cache_prefix(b"5", CachedPrefix(4, b.table("a")[:1], nbytes=101))  # alone over the bound
    assert list(b.prefixes) == [b"3", b"4"] and b.prefix_bytes == 100
    b.clear_prefixes()
    assert b.prefix_bytes == 0
    b.check()
    with pytest.raises(ValueError, match="max_prefix_bytes must be an int >= 0 or None"):
        BlockManager(8, 6, pages, max_prefixes=2, max_prefix_bytes=-1)


def test_pages_only_the_cache_holds_are_evicted_before_a_running_request_is_preempted():
    blocks = BlockManager(6, 6, pages, max_prefixes=4)
    sched = Scheduler(blocks, 4)
    a = Seq("a", 8, 1)
    sched.schedule(collections.deque([a]), Seq.tokens)
    blocks.cache_prefix(b"old", CachedPrefix(4, blocks.table(a)[:1]))
    blocks.cache_prefix(b"new", CachedPrefix(8, blocks.table(a)[:2]))
    sched.finish(a)
    assert blocks.num_free == 4 and blocks.num_reclaimable == 2
    b, c = Seq("b", 4, 20), Seq("c", 4, 20)
    sched.schedule(collections.deque([b, c]), Seq.tokens)  # 2 pages each: the 4 free ones
    assert sched.running == [b, c] and blocks.num_free == 0
    b.generated = 5  # b needs a third page: the cache gives up "new" (LRU "old" would free nothing:
    plan = sched.schedule(collections.deque(), Seq.tokens)  # its page is in "new" too), "old" stays
    assert not plan.preempted and sched.preemptions == 0 and blocks.evictions == 1 and list(blocks.prefixes) == [b"old"]
    blocks.check()
    assert blocks.num_free == 0 and blocks.num_reclaimable == 1
    b.generated = 13  # 2 more pages, none free, 1 reclaimable: now c (the newest) is preempted
    plan = sched.schedule(collections.deque(), Seq.tokens)
    assert [s for s, _ in plan.preempted] == [c]
    blocks.check()


def test_reclaim_evicts_only_prefixes_whose_eviction_frees_a_page():
    # The least recently used prefix's pages are held by a running sequence, the next one's page by
    # a newer prefix too: evicting either frees nothing, so only the newest goes, and the older two
    # stay cached for the requests that would share them.
    b = BlockManager(8, 8, pages, max_prefixes=4)
    evicted = []
    b.on_evict = lambda prefix: evicted.append(prefix.payload)
    b.allocate("a", 16)  # pages 0-3, still running
    b.cache_prefix(b"a8", CachedPrefix(8, b.table("a")[:2], "a8"))
    b.allocate("b", 8)  # pages 4, 5
    b.cache_prefix(b"b4", CachedPrefix(4, b.table("b")[:1], "b4"))
    b.cache_prefix(b"b8", CachedPrefix(8, b.table("b")[:2], "b8"))
    b.free("b")
    b.allocate("c", 8)  # the last two free pages
    assert b.num_free == 0 and b.num_reclaimable == 2
    assert b.reclaim(1)
    assert evicted == ["b8"] and list(b.prefixes) == [b"a8", b"b4"] and b.num_free == 1
    b.check()
    assert not b.reclaim(3) and evicted == ["b8"]  # 1 free + 1 reclaimable cannot make 3: nothing goes
    assert b.reclaim(2) and evicted == ["b8", "b4"] and list(b.prefixes) == [b"a8"] and b.num_free == 2
    b.check()
    # Pages that only several prefixes hold (here two on the same pages): no one eviction frees a
    # page, yet together they are reclaimable, so they go in LRU order until the pages come free.
    b = BlockManager(4, 4, pages, max_prefixes=4)
    b.allocate("a", 8)
    b.cache_prefix(b"x", CachedPrefix(8, b.table("a")))
    b.cache_prefix(b"y", CachedPrefix(8, b.table("a")))
    b.free("a")
    b.allocate("z", 8)
    assert b.num_free == 0 and b.num_reclaimable == 2
    assert b.reclaim(1) and b.evictions == 2 and not b.prefixes and b.num_free == 2
    b.check()


def test_admission_takes_the_longest_cached_prefix_and_waits_whole_when_the_rest_does_not_fit():
    blocks = BlockManager(5, 6, pages, max_prefixes=4)
    sched = Scheduler(blocks, 4)
    a = Seq("a", 8, 30)
    sched.schedule(collections.deque([a]), Seq.tokens)  # 3 pages
    blocks.cache_prefix(b"8", CachedPrefix(8, blocks.table(a)[:2], payload="p8"))
    keys = {"b": [b"4", b"8"], "c": [b"8"]}
    b, c = Seq("b", 11, 5), Seq("c", 20, 5)  # b: 3 pages, 2 shared; c: 6 pages, more than fit
    waiting = collections.deque([b, c])
    plan = sched.schedule(waiting, Seq.tokens, lambda s: keys[s.name])
    assert plan.admitted == [b] and plan.hits[b].payload == "p8" and list(waiting) == [c]
    assert blocks.table(b)[:2] == blocks.table(a)[:2] and blocks.num_shared == 2
    assert c not in blocks.tables  # its share was undone: it holds nothing while it waits
    blocks.check()
    plan = sched.schedule(waiting, Seq.tokens)  # without prefix_keys: no lookup, no hits
    assert not plan.hits


def test_a_random_workload_with_prefix_caching_finishes_with_the_pool_intact():
    rng = random.Random(1)
    for trial in range(20):
        seqs = [Seq(f"s{i}", rng.randint(1, 20), rng.randint(1, 20)) for i in range(rng.randint(1, 12))]
        group = {s.name: rng.randint(0, 2) for s in seqs}  # sequences of a group start with the same tokens
        num_pages = max(pages(s.prompt + s.max_tokens) for s in seqs) + rng.randint(0, 6)
        blocks = BlockManager(num_pages, 64, pages, max_prefixes=rng.randint(1, 5))
        sched = Scheduler(blocks, rng.randint(1, 6))
        waiting = collections.deque(seqs)
        keys = lambda s: [f"{group[s.name]}:{n}".encode() for n in range(1, (s.prompt - 1) // PS + 1)]  # noqa: E731
        done = []
        for _ in range(10_000):
            if not (waiting or sched.running or sched.swapped):
                break
            plan = sched.schedule(waiting, Seq.tokens, keys)
            for s in plan.admitted:  # cache the prefixes its prompt made (the engine: after its prefill)
                for n, key in enumerate(keys(s), start=1):
                    blocks.cache_prefix(key, CachedPrefix(n * PS, blocks.table(s)[:n]))
            for s in sched.running:
                assert len(blocks.table(s)) >= pages(s.tokens())
            blocks.check()
            for s in list(sched.running):
                s.generated += 1
                if s.generated >= s.max_tokens:
                    sched.finish(s)
                    done.append(s.name)
        assert sorted(done) == sorted(s.name for s in seqs), trial
        blocks.clear_prefixes()
        assert blocks.num_free == num_pages, trial
