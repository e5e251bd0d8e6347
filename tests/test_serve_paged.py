"""`kivi serve --paged`: the engine over a paged cache (a pool of pages, block_manager.py) on a tiny
random Llama with the embedded model's tokenizer (a step takes milliseconds; EOS off, so every
request runs to max_tokens). A pool too small for the load forces preemptions (swap to host and
back): greedy outputs still equal an uninterrupted run token for token, and `kivi generate`'s text;
pages come back; a request that could never fit gets a 400 naming the limit; the compiled step
stays one graph. The openai client runs against uvicorn on 127.0.0.1."""

from __future__ import annotations

import collections
import threading
import time

import httpx
import pytest
import torch

from kivi_serve.request import Failure, Request, RequestError
from serve_fixtures import (CONFIG, LENGTHS, MAX_SEQ_LEN, METHODS, NAME, PROMPTS, alone, complete_all,  # noqa: F401
                            make_engine, metrics, serving, tiny, wait_idle)


@pytest.mark.parametrize("method", METHODS)
def test_preempted_requests_give_the_tokens_of_an_uninterrupted_run(tiny, method):
    page = 4 if method == "fp" else CONFIG.group_size
    roomy = make_engine(tiny, method, num_pages=200, page_size=page)
    try:
        want = complete_all(roomy, PROMPTS, LENGTHS)
        assert roomy.stats()["preemptions"] == 0
    finally:
        roomy.close()
    # 5 requests of 23-37 tokens in 4 rows, a pool of 16 pages of 4 tokens (64 tokens): it runs out.
    small = make_engine(tiny, method, num_pages=16 if method == "fp" else 8, page_size=page)
    try:
        got = complete_all(small, PROMPTS, LENGTHS)
        stats = wait_idle(small)
    finally:
        small.close()
    assert stats["preemptions"] > 0, stats
    assert got == want  # swapping out and back changes no bit: the same greedy tokens
    assert stats["pages_used"] == 0 and stats["pages_free"] == small.snapshot()["num_pages"]
    small.check()
    for prompt, n, tokens in zip(PROMPTS, LENGTHS, got):
        assert tokens == alone(tiny, method, prompt, n), prompt


@pytest.mark.parametrize("method", METHODS)
def test_a_request_that_could_never_fit_the_pool_is_refused_naming_the_limit(tiny, method):
    engine = make_engine(tiny, method, num_pages=4, page_size=8)
    try:
        ids = engine.tokenizer(PROMPTS[0])["input_ids"]
        # The pool holds 32 tokens (fp) or 32 quantized tokens plus the window (KIVI).
        big = min(m for m in range(1, MAX_SEQ_LEN) if engine.capacity_error(len(ids), m) is not None)
        assert len(ids) + big == (33 if method == "fp" else 40)  # KIVI: 40 // R * R = 40 quantized tokens: 5 pages
        with pytest.raises(RequestError, match=r"more than the whole pool of 4 pages.*--num-pages") as e:
            engine.submit(Request(prompt_ids=ids, max_tokens=big, emit=lambda *a: None))
        assert e.value.status == 400 and e.value.param == "max_tokens" and e.value.code == "context_length_exceeded"
        with pytest.raises(RequestError, match="pool of 4 pages") as e:
            engine.submit(Request(prompt_ids=list(range(5, 80)), max_tokens=1, emit=lambda *a: None))
        assert e.value.param == "prompt"
    finally:
        engine.close()


# In `make test-slow`: each is a cold Inductor build of the paged step (56 s on the 2-core machine).
# `make test` compiles a served step in tests/test_serve.py (static rows, the embedded model) and
# runs this paged engine uncompiled in the tests below.
@pytest.mark.slow
@pytest.mark.parametrize("method", METHODS)
def test_openai_client_streamed_and_whole_with_preemptions_equals_kivi_generate_one_compiled_graph(tiny, method):
    from openai import OpenAI

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    engine = make_engine(tiny, method, num_pages=16 if method == "fp" else 8, page_size=4 if method == "fp" else 4,
                         compile=True)
    real_step = engine.step_fn

    def paced(*args, **kwargs):  # steps slower than the 0.05 s arrivals: the requests overlap and
        time.sleep(0.02)         # outgrow the pool however fast this machine is (else no preemption)
        return real_step(*args, **kwargs)

    engine.step_fn = paced
    _, tokenizer = tiny
    results = {}
    try:
        with serving(engine) as url:
            c = OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=120, max_retries=0)

            def ask(i):
                time.sleep(0.05 * i)
                if i % 2:
                    parts = c.completions.create(model=NAME, prompt=PROMPTS[i], max_tokens=LENGTHS[i], temperature=0,
                                                 stream=True)
                    results[i] = "".join(p.choices[0].text for p in parts)
                else:
                    results[i] = c.completions.create(model=NAME, prompt=PROMPTS[i], max_tokens=LENGTHS[i],
                                                      temperature=0).choices[0].text

            threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(PROMPTS))]
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout=180)
            m = metrics(url)
            # a request that could never fit: a 400 naming the limit, and the server keeps serving
            r = httpx.post(f"{url}/v1/completions", timeout=30,
                           json={"model": NAME, "prompt": PROMPTS[0], "max_tokens": MAX_SEQ_LEN - 10})
            assert r.status_code == 400 and "--num-pages" in r.json()["error"]["message"], r.text
            # a client that hangs up mid-stream gives its pages back
            with httpx.stream("POST", f"{url}/v1/completions", timeout=60,
                              json={"model": NAME, "prompt": PROMPTS[1], "max_tokens": 40, "stream": True}) as s:
                next(s.iter_lines())
            end = time.time() + 30
            while (m2 := metrics(url))["kivi_cache_pages_used"] and time.time() < end:
                time.sleep(0.05)
            assert m2["kivi_cache_pages_used"] == 0 and m2["kivi_cache_pages_free"] == engine.snapshot()["num_pages"]
    finally:
        engine.close()
    assert len(results) == len(PROMPTS)
    for i, text in results.items():
        want = tokenizer.decode(alone(tiny, method, PROMPTS[i], LENGTHS[i]), skip_special_tokens=True)
        assert text == want, PROMPTS[i]
    assert m["kivi_preemptions_total"] > 0 and m["kivi_cache_pages_shared"] == 0, m
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    assert sum(torch._dynamo.utils.counters["recompiles"].values()) == 0


# Compiled, three bucket graphs cold (a minute and a half of `make test`): `make test-slow`; the fast
# suite's compiled paged serving is the OpenAI-client test above.
@pytest.mark.parametrize("method, compile", [("fp", False), ("kivi", False),
                                             pytest.param("kivi", True, marks=pytest.mark.slow)])
def test_decode_steps_run_over_the_smallest_bucket_holding_the_requests(tiny, method, compile):
    """Rows 6, buckets 2, 4, 6: requests arrive and leave at different times, in a pool small
    enough for preemptions. Every step runs over the smallest bucket holding the running requests
    (those in higher rows are moved down), and the tokens are still `kivi generate`'s. Compiled:
    one graph per bucket, all built before the first request."""
    if compile:
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
    engine = make_engine(tiny, method, num_pages=24 if method == "fp" else 12, page_size=4, slots=6,
                         decode_buckets=(2, 4), compile=compile)
    assert engine.placement.buckets == (2, 4, 6)
    steps, moves = [], []
    real_decode, real_move = engine.runner.decode, engine.runner.move

    def decode(tokens):
        rows = engine.snapshot()["rows"]
        steps.append((len(tokens), sum(r is not None for r in rows), max(
            (i for i, r in enumerate(rows) if r is not None), default=-1)))
        return real_decode(tokens)

    def move(src, dst):
        moves.append((src, dst))
        return real_move(src, dst)

    assert engine.ready.wait(300)
    recompiles = sum(torch._dynamo.utils.counters["recompiles"].values())
    engine.runner.decode, engine.runner.move = decode, move
    prompts, lengths = PROMPTS * 2, [30, 6, 26, 4, 24, 8, 12, 28, 5, 20]  # short ones leave rows free early
    try:
        # one step apart: 0-3 steps apart all preempt and use every bucket here; 4 does not (measured)
        got = complete_all(engine, prompts, lengths, steps_apart=1)
        stats = wait_idle(engine)
    finally:
        engine.close()
    for prompt, n, tokens in zip(prompts, lengths, got):
        assert tokens == alone(tiny, method, prompt, n), prompt
    assert stats["preemptions"] > 0 and moves, (stats, moves)
    assert {rows for rows, _, _ in steps} == {2, 4, 6}, steps
    for rows, running, highest in steps:
        assert highest < rows and rows == engine.placement.bucket(running), steps
    engine.check()
    if compile:
        assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 3
        assert sum(torch._dynamo.utils.counters["recompiles"].values()) == recompiles  # none after warm-up


def test_decode_buckets_default_and_refusals():
    from kivi_serve.paged_options import DEFAULT_MAX_BUCKETS, decode_buckets

    assert decode_buckets(94) == (8, 16, 32, 64, 94) and decode_buckets(8) == (8,) and decode_buckets(5) == (5,)
    assert decode_buckets(4096) == (32, 64, 128, 256, 512, 1024, 2048, 4096)  # the largest, 8 compiles at warm-up
    assert len(decode_buckets(10**6)) == DEFAULT_MAX_BUCKETS and decode_buckets(10**6)[-1] == 10**6
    assert decode_buckets(20, (4, 12)) == (4, 12, 20)
    assert decode_buckets(100, tuple(range(1, 16))) == (*range(1, 16), 100)  # more when asked (compile_budget.py)
    with pytest.raises(ValueError, match="--decode-buckets: at most 16 row counts, --max-batch \\(100\\) included"):
        decode_buckets(100, tuple(range(1, 17)))
    with pytest.raises(ValueError, match=r"--decode-buckets must be row counts in \[1, 20\] \(--max-batch\)"):
        decode_buckets(20, (4, 21))


def test_swapped_requests_end_cleanly_on_cancel_timeout_and_abort(tiny):
    # A pool that holds one request at a time: the second one is preempted, then cancelled; a third
    # times out while swapped out or waiting; abort ends what is left. Every page comes back.
    engine = make_engine(tiny, "fp", num_pages=10, page_size=4, slots=2, request_timeout=30)
    events = collections.defaultdict(list)
    real_step = engine.step_fn

    def slow(*args, **kwargs):
        time.sleep(0.01)
        return real_step(*args, **kwargs)

    engine.step_fn = slow
    try:
        ids = engine.tokenizer(PROMPTS[0])["input_ids"]
        reqs = [Request(prompt_ids=ids, max_tokens=30, temperature=0, emit=lambda k, p, i=i: events[i].append(k))
                for i in range(3)]
        for r in reqs[:2]:
            engine.submit(r)
        end = time.time() + 30
        while not engine.stats()["swapped"] and time.time() < end:
            time.sleep(0.005)
        assert engine.stats()["swapped"] == 1 and engine.stats()["preemptions"] >= 1
        engine.cancel(reqs[1])  # the swapped one
        engine.submit(reqs[2])
        end = time.time() + 30
        while not (engine.stats()["swapped"] == 0 and "done" in events[0]) and time.time() < end:
            time.sleep(0.005)
        assert "done" in events[0] and reqs[1].saved is None
        engine.abort("stopping")  # from this thread: the engine thread ends them at its next round
        s = wait_idle(engine)
        assert events[2][-1] == "error" or "done" in events[2]
        assert s["pages_used"] == 0 and s["pages_free"] == 10
        engine.check()
    finally:
        engine.close()


@pytest.mark.parametrize("then_close", [False, True], ids=["abort", "abort-then-close"])
def test_an_abort_from_another_thread_leaves_the_running_step_alone_and_ends_each_request_once(tiny, then_close):
    # abort() comes from another thread (a signal, drain's timer) while the engine thread is mid-step
    # on the very rows, pages and host copies abort ends. It only marks (and refuses new requests):
    # nothing is released from that thread, and once the step ends the engine thread ends each
    # request (running, swapped out, waiting) with exactly one 503, also when close() came first.
    engine = make_engine(tiny, "fp", num_pages=10, page_size=4, slots=2)
    events = collections.defaultdict(list)
    callers = []  # the thread of every runner.drop / placement.finish
    real_step, real_drop, real_finish = engine.step_fn, engine.runner.drop, engine.placement.scheduler.finish
    armed, entered, release = threading.Event(), threading.Event(), threading.Event()

    def step(*args, **kwargs):
        if armed.is_set() and engine.snapshot()["swapped"]:  # once one request is swapped out: hold this step
            armed.clear()
            entered.set()
            release.wait(30)
        return real_step(*args, **kwargs)

    def drop(key):
        callers.append(threading.current_thread())
        real_drop(key)

    def finish(seq):
        callers.append(threading.current_thread())
        real_finish(seq)

    engine.step_fn, engine.runner.drop, engine.placement.scheduler.finish = step, drop, finish
    ids = engine.tokenizer(PROMPTS[0])["input_ids"]

    def request(i):
        return Request(prompt_ids=ids, max_tokens=30, temperature=0, emit=lambda k, p, i=i: events[i].append((k, p)))

    reqs = [request(i) for i in range(3)]
    closer = threading.Thread(target=engine.close)
    try:
        armed.set()
        for r in reqs[:2]:  # a pool for one: the second is preempted (swapped out)
            engine.submit(r)
        assert entered.wait(30), engine.stats()
        engine.submit(reqs[2])  # waits: the engine thread is mid-step
        before = (engine.snapshot(), set(engine.runner.saved))
        assert reqs[0].id in before[0]["rows"] and before[0]["swapped"] == [reqs[1].id] and reqs[1].key in before[1]
        engine.abort("stopping now", code="test_abort")
        with pytest.raises(RequestError) as refused:
            engine.submit(request(3))
        assert refused.value.status == 503
        after = (engine.snapshot(), set(engine.runner.saved))
        assert after == before and not callers  # the step still owns them
        if then_close:
            closer.start()
        release.set()
        end = time.time() + 30
        while not all(events[i] and events[i][-1][0] == "error" for i in range(3)) and time.time() < end:
            time.sleep(0.005)
        if then_close:
            closer.join(30)
            assert not engine.thread.is_alive()
        else:
            wait_idle(engine)
        for i in range(3):
            ends = [(k, p) for k, p in events[i] if k != "text"]
            assert ends == [("error", Failure(503, "stopping now", "test_abort"))], (i, events[i])
        assert callers and all(t is engine.thread for t in callers), callers
        assert engine.snapshot()["pages_free"] == 10 and not engine.runner.saved
        engine.check()
    finally:
        release.set()
        engine.close()


@pytest.mark.parametrize("action", ["close", "cancel", "abort"])
def test_a_round_of_many_prefills_stops_at_the_next_one_on_close_cancel_or_abort(tiny, action):
    # One round admits six prompts; on a CPU each prefill can take seconds. What comes during the
    # first one is heeded before the second: close() stops the engine thread (it used to wait out
    # the round, give up after 30 s and leave the thread in torch code at interpreter exit, where
    # `kivi bench serve` died with "terminate called without an active exception"), cancelled
    # requests are not prefilled, and an abort ends every request with one 503 at once (close()
    # too: before, its requests got no event at all and their handlers waited forever).
    engine = make_engine(tiny, "fp", num_pages=64, page_size=4, slots=6)
    real_prefill, prefills = engine.runner.prefill, []
    entered, go = threading.Event(), threading.Event()

    def prefill(*args):
        prefills.append(args[0])
        if len(prefills) == 1:
            entered.set()
            go.wait(30)
        return real_prefill(*args)

    engine.runner.prefill = prefill
    events = collections.defaultdict(list)
    ids = engine.tokenizer(PROMPTS[0])["input_ids"]
    reqs = [Request(prompt_ids=ids, max_tokens=8, temperature=0, emit=lambda k, p, i=i: events[i].append((k, p)))
            for i in range(6)]
    closer = threading.Thread(target=engine.close)
    try:
        with engine.lock:  # the engine thread admits all six in one round
            for r in reqs:
                engine.submit(r)
        assert entered.wait(30)
        if action == "close":
            closer.start()
        elif action == "cancel":
            for r in reqs:
                engine.cancel(r)
        else:
            engine.abort("stopping now", code="test_abort")
        end = time.time() + 10
        while action == "close" and not engine.core.stopping and time.time() < end:
            time.sleep(0.001)  # close() has asked before the first prefill returns
        go.set()
        if action == "close":
            closer.join(10)
            assert not engine.thread.is_alive()
        else:
            wait_idle(engine)
        assert len(prefills) == 1, prefills
        if action != "cancel":  # each request ends once, with the abort's 503 or close()'s
            failure = (Failure(503, "stopping now", "test_abort") if action == "abort"
                       else Failure(503, "the engine was closed", "server_shutting_down"))
            for i in range(6):
                assert [e for e in events[i] if e[0] != "text"] == [("error", failure)], (i, events[i])
        elif action == "cancel":
            assert not any(k == "error" for i in range(6) for k, _ in events[i])
        engine.check()
        if action != "close":
            assert engine.snapshot()["pages_free"] == 64
    finally:
        go.set()
        engine.close()


def test_submits_and_cancels_from_many_threads_are_applied_by_the_engine_thread_alone_and_none_is_lost(tiny):
    # Handlers only queue commands (issue 51): the queue, the rows and the pages change on the engine
    # thread alone, whatever many threads submit and cancel at once; each submit is applied once, each
    # request not cancelled completes, and once idle every page is back.
    engine = make_engine(tiny, "fp", num_pages=12, page_size=4, slots=3)  # tight: some are preempted
    mutations = []  # (what, thread) of every change to the queue, a row or the pages

    def record(name, fn):
        def recorded(*args, **kwargs):
            mutations.append((name, threading.current_thread()))
            return fn(*args, **kwargs)
        return recorded

    class Waiting(collections.deque):
        pass

    for name in ("append", "appendleft", "extend", "extendleft", "pop", "popleft", "remove", "clear", "insert",
                 "rotate", "__delitem__", "__setitem__", "__iadd__"):
        setattr(Waiting, name, record(name, getattr(collections.deque, name)))
    placement = engine.placement
    with engine.lock:
        placement.waiting = Waiting(placement.waiting)
        placement.plan, placement.leave = record("plan", placement.plan), record("leave", placement.leave)
        placement.scheduler.finish = record("finish", placement.scheduler.finish)
    ids = engine.tokenizer(PROMPTS[0])["input_ids"]
    reqs, events, cancelled = [], collections.defaultdict(list), set()
    submitted = threading.Condition()

    def submitter(t):
        for i in range(6):
            r = Request(prompt_ids=ids, max_tokens=4 + (t + i) % 9, temperature=0,
                        emit=lambda k, p, key=(t, i): events[key].append(k))
            r.test_key = (t, i)
            engine.submit(r)
            with submitted:
                reqs.append(r)
                submitted.notify()

    def canceller():
        seen = 0
        while seen < 48:
            with submitted:
                submitted.wait_for(lambda: len(reqs) > seen, timeout=30)
                new, seen = reqs[seen:], len(reqs)
            for r in new[::3]:  # every third, at once: before, while or after the engine thread applies its submit
                cancelled.add(r.test_key)
                engine.cancel(r)

    try:
        assert engine.ready.wait(120)
        threads = [threading.Thread(target=submitter, args=(t,)) for t in range(8)] + [threading.Thread(target=canceller)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert len(reqs) == 48 and len(cancelled) >= 16
        end = time.time() + 60
        while time.time() < end and not all("done" in events[r.test_key] for r in reqs if r.test_key not in cancelled):
            time.sleep(0.01)
        s = wait_idle(engine)
        for r in reqs:
            ends = [k for k in events[r.test_key] if k != "text"]
            if r.test_key in cancelled:
                assert ends in ([], ["done"]), (r.test_key, events[r.test_key])
            else:
                assert ends == ["done"] and len(r.tokens) == r.max_tokens, (r.test_key, events[r.test_key])
        assert sum(name == "append" for name, _ in mutations) == 48  # each submit applied once
        assert mutations and all(t is engine.thread for _, t in mutations), {t.name for _, t in mutations}
        assert s["pages_free"] == 12 and engine.snapshot()["waiting"] == []
        engine.check()
    finally:
        engine.close()


def test_a_full_queue_counts_the_submits_the_engine_thread_has_not_applied_yet(tiny):
    # While the engine thread is inside a step, submits only queue: --max-waiting must count them,
    # or twelve racing submits would all be accepted. One row is free and three may wait: four of
    # twelve get in, the other eight get 503 server_busy, and the four complete once the step ends.
    engine = make_engine(tiny, "fp", num_pages=64, page_size=4, slots=2, max_waiting=3)
    real_step, hold, entered, release = engine.step_fn, threading.Event(), threading.Event(), threading.Event()

    def step(*args, **kwargs):
        if hold.is_set():
            hold.clear()
            entered.set()
            release.wait(30)
        return real_step(*args, **kwargs)

    engine.step_fn = step
    ids = engine.tokenizer(PROMPTS[0])["input_ids"]
    done, refused, accepted = [], [], []
    barrier = threading.Barrier(12)

    def submit():
        r = Request(prompt_ids=ids, max_tokens=4, temperature=0, emit=lambda k, p: done.append(k) if k == "done" else None)
        barrier.wait(30)
        try:
            engine.submit(r)
            accepted.append(r)
        except RequestError as e:
            refused.append((e.status, e.code))

    try:
        assert engine.ready.wait(120)
        hold.set()
        engine.submit(Request(prompt_ids=ids, max_tokens=8, temperature=0,
                              emit=lambda k, p: done.append(k) if k == "done" else None))
        assert entered.wait(30)
        threads = [threading.Thread(target=submit) for _ in range(12)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert len(accepted) == 4 and refused == [(503, "server_busy")] * 8, (len(accepted), refused)
        assert engine.stats()["waiting"] == 4
        release.set()
        end = time.time() + 60
        while len(done) < 5 and time.time() < end:
            time.sleep(0.01)
        assert len(done) == 5
        wait_idle(engine)
        engine.check()
    finally:
        release.set()
        engine.close()


def test_a_swap_out_that_fails_ends_that_request_alone(tiny):
    # Host memory runs out while a request is preempted: it ends with an error event, the running
    # one finishes with its uninterrupted tokens, and nothing later waits for the missing copy.
    ids = tiny[1](PROMPTS[0])["input_ids"]
    want = alone(tiny, "fp", PROMPTS[0], 30)
    engine = make_engine(tiny, "fp", num_pages=10, page_size=4, slots=2)
    real_save, failures = engine.runner.save, []

    def save(*args):
        failures.append(args)
        raise MemoryError("pinned host memory exhausted")

    engine.runner.save = save
    try:
        events = [[], []]
        reqs = [Request(prompt_ids=ids, max_tokens=30, temperature=0, emit=lambda k, p, i=i: events[i].append((k, p)))
                for i in range(2)]
        for r in reqs:
            engine.submit(r)
        s = wait_idle(engine)
    finally:
        engine.runner.save = real_save
        engine.close()
    assert failures and s["preemptions"] >= 1
    last = sorted((e[-1][0], i) for i, e in enumerate(events))
    assert [kind for kind, _ in last] == ["done", "error"], events  # one each
    failed = last[1][1]
    assert "saving it to host memory failed: MemoryError" in events[failed][-1][1].message
    assert reqs[1 - failed].tokens == want
    assert engine.runner.saved == {} and s["pages_used"] == 0 and s["swapped"] == 0
    engine.check()
