"""Tensor-parallel `kivi serve` in one process (the fast suite): the plan's encoding, and a worker
executing rank 0's plans. The leader's channel here is a loopback to an in-process Worker over its
own Runner (the same tiny model, its own caches): after the engine has served requests (static
rows; paged with preemptions), the worker's cache must equal rank 0's bit for bit, which is what
makes the real ranks' shards line up. A channel that fails stands for a dead rank. The torchrun
runs (real processes, gloo) are in tests/test_serve_tp_torchrun.py."""

from __future__ import annotations

import functools
import threading
import time

import pytest
import torch

from kivi_serve.config import ServeConfig
from kivi_serve.engine import Engine
from kivi_serve.paged_options import PagedServing
from kivi_serve.request import Request, RequestError
from kivi_serve.runner import Runner
from kivi_serve.plan import Plan, Prefill, Swap
from kivi_serve.tp import HEADER, PLAN, STOP, LeaderRunner, OutOfStep, Sent, Worker, decode_plan, encode_plan, signature
from serve_fixtures import CONFIG, LENGTHS, MAX_SEQ_LEN, PROMPTS, complete_all, tiny  # noqa: F401 (fixture)


# ---------------------------------------------------------------- the plan's encoding


def test_a_plan_survives_encoding_and_a_decode_step_is_one_header_and_a_short_payload():
    plan = Plan(swap_out=(Swap(2, 41, (7, 3, 9)),), swap_in=(Swap(0, 40, (1,)),),
                prefills=(Prefill(1, 44, (101, 5, 17, 2), (4, 8)), Prefill(2, 45, (101, 5, 17, 2, 9), (4, 8, 3), 4, 4, 1, 38),
                          Prefill(0, 46, (7,) * 9, (2, 5, 6), 4, 0, 0, -1, (4, 8), (42, 43))),
                drops=(39,), moves=((3, 0),), table=((1, (5, 6)), (3, ())), decode=(5, -1, 9, -1), stop_compiling=True)
    assert all(getattr(plan, f) for f in plan.__dataclass_fields__)  # every field
    header, payload = encode_plan(Sent(PLAN, 12, plan))
    assert header.dtype == payload.dtype == torch.long and header.shape == (HEADER,)
    assert decode_plan(header, payload) == Sent(PLAN, 12, plan)
    # A pure decode step: six counts, the tokens, the flag.
    header, payload = encode_plan(Sent(PLAN, 13, Plan(decode=(5, -1, 9, -1))))
    assert payload.tolist() == [0] * 6 + [4, 5, -1, 9, -1, 0]
    assert decode_plan(header, payload) == Sent(PLAN, 13, Plan(decode=(5, -1, 9, -1)))
    stop = decode_plan(*encode_plan(Sent(STOP, 14)))
    assert stop.kind == STOP and stop.plan == Plan()


def test_a_plan_that_is_not_one_is_refused():
    header, payload = encode_plan(Sent(PLAN, 0, Plan(swap_out=(Swap(0, 3, (1, 2)),))))
    with pytest.raises(OutOfStep, match="not a plan header"):
        decode_plan(torch.zeros_like(header), payload)
    with pytest.raises(OutOfStep, match=f"announces {payload.numel()} payload ints, got {payload.numel() - 1}"):
        decode_plan(header, payload[:-1])
    bad = payload.clone()
    bad[3] = 99  # the page list claims 99 ids
    with pytest.raises(OutOfStep, match="runs past the end"):
        decode_plan(header, bad)
    longer, more = torch.cat([payload, torch.tensor([7])]), header.clone()
    more[3] += 1
    with pytest.raises(OutOfStep, match="1 payload ints past the plan's end"):
        decode_plan(more, longer)


# ---------------------------------------------------------------- a worker replaying rank 0's plans


class Loopback:
    """Rank 0's channel to one in-process worker: each plan is decoded and executed at once, in the
    sending thread (a model without tensor parallelism has no collectives to line up).
    fail_after: sending that many plans, the next raises as a dead peer's connection does."""

    def __init__(self, runner: Runner, fail_after=None):
        self.runner, self.worker, self.fail_after = runner, Worker(runner), fail_after
        self.plans: list[Sent] = []

    def gather(self, row: torch.Tensor) -> torch.Tensor:
        return torch.stack([row, signature(self.runner)])

    def send(self, header: torch.Tensor, payload: torch.Tensor) -> None:
        if self.fail_after is not None and len(self.plans) >= self.fail_after:
            raise ConnectionResetError("Connection reset by peer (rank 1)")
        plan = decode_plan(header.clone(), payload.clone())
        self.plans.append(plan)
        self.worker.apply(plan)


def tp_engine(tiny, method, paging=None, slots=4, fail_after=None, timeout_s=60.0, **options):
    """An engine whose runner leads one in-process worker; (engine, the loopback channel)."""
    model, tokenizer = tiny
    args = dict(method=method, kivi_config=CONFIG, slots=slots, max_seq_len=MAX_SEQ_LEN, paging=paging)
    channel = Loopback(Runner(model, **args), fail_after)
    engine = Engine(model, tokenizer, ServeConfig(**args, eos_token_ids=set(), served_model_name="tiny", **options),
                    make_runner=functools.partial(LeaderRunner, channel=channel, timeout_s=timeout_s))
    return engine, channel


def assert_same_cache(a: Runner, b: Runner) -> None:
    ours, theirs = dict(a.cache.named_buffers()), dict(b.cache.named_buffers())
    assert ours.keys() == theirs.keys() and ours
    for name, buf in ours.items():
        assert torch.equal(buf, theirs[name]), name


def serve_alone_and_tp(tiny, method, paging, prompts):
    """The same greedy requests served by a single-process engine and by a leader with one
    in-process worker: (tokens alone, tokens under TP, the TP engine's stats, engine, channel)."""
    model, tokenizer = tiny
    alone = Engine(model, tokenizer, ServeConfig(method=method, kivi_config=CONFIG, slots=4, max_seq_len=MAX_SEQ_LEN,
                                                 paging=paging, eos_token_ids=set()))
    try:
        want = complete_all(alone, prompts, LENGTHS)
    finally:
        alone.close()
    engine, channel = tp_engine(tiny, method, paging)
    try:
        got = complete_all(engine, prompts, LENGTHS, steps_apart=1)  # overlapping on any machine: the pools preempt
        stats = engine.stats()
    finally:
        engine.close()
    return want, got, stats, engine, channel


@pytest.mark.parametrize("method, paging", [("kivi", None), ("fp", PagedServing(16, 4)), ("kivi", PagedServing(8, 4)),
                                            ("kivi", PagedServing(8, 4, decode_buckets=(2,)))],
                         ids=["static-kivi", "paged-fp", "paged-kivi", "paged-kivi-buckets"])
def test_a_worker_replaying_the_plans_holds_rank_0s_cache_bit_for_bit(tiny, method, paging):
    if paging is not None and method == "kivi":
        pytest.importorskip("kivi_ops.cache.paged")
    want, got, stats, engine, channel = serve_alone_and_tp(tiny, method, paging, PROMPTS)
    assert got == want
    assert channel.plans[-1].kind == STOP and channel.worker.seq == len(channel.plans)
    assert_same_cache(engine.runner, channel.runner)
    assert engine.runner.saved == channel.runner.saved == {}
    assert stats["tp_size"] == 2 and stats["cache_bytes_by_rank"] == [engine.cache.nbytes()] * 2
    ops = collections_of(channel.plans)
    assert ops["prefills"] == len(PROMPTS)
    steps = [s.plan for s in channel.plans if s.plan.decode]
    assert len(steps) >= max(LENGTHS) - 1
    # a prefill is a plan of its own (the engine may stop between two); what rides with a step is
    # the pages' bookkeeping
    assert not any(p.prefills for p in steps)
    if paging is None:  # a static cache has no block table
        assert ops["table"] == 0
    if paging is not None:  # the small pools preempt: swaps and block table rows reached the worker
        assert stats["preemptions"] > 0 and ops["swap_out"] == ops["swap_in"] == stats["preemptions"]
        assert ops["table"] > 0
    if paging is not None and paging.decode_buckets:  # steps over the first 2 rows as well as all 4
        assert {len(p.decode) for p in steps} == {2, 4}, ops


def test_a_row_moved_down_and_a_step_over_the_first_rows_replay_on_the_worker(tiny):
    """A row move (the engine keeps requests in the lowest rows) and a decode step over a bucket
    of rows reach the worker: both ranks' caches stay the same bit for bit."""
    pytest.importorskip("kivi_ops.cache.paged")
    model, tokenizer = tiny
    args = dict(method="kivi", kivi_config=CONFIG, slots=4, max_seq_len=MAX_SEQ_LEN, paging=PagedServing(8, 4))
    channel = Loopback(Runner(model, **args))
    leader = LeaderRunner(model, channel=channel, timeout_s=60.0, **args)
    ids = tokenizer(" ".join(PROMPTS[:3]))["input_ids"]  # past the window: it holds pages
    pages = tuple(range(leader.cache.pages_needed(len(ids) + 1)))
    assert pages
    with torch.inference_mode():
        out = leader.execute(Plan(prefills=(Prefill(3, 0, tuple(ids), pages[:leader.cache.pages_needed(len(ids))]),),
                                  table=((3, pages),)))
        token = int(out.prefill_logits[3].argmax())
        leader.execute(Plan(moves=((3, 0),), table=((0, pages), (3, ())), decode=(token, -1)))
    assert channel.plans[-1].plan.moves == ((3, 0),) and channel.plans[-1].plan.decode == (token, -1)
    assert int(leader.cache.lengths()[0]) == len(ids) + 1
    assert_same_cache(leader, channel.runner)


def test_prefix_caching_replays_on_a_worker_with_its_own_tails(tiny):
    """--prefix-caching under tensor parallelism: the chunked prefills (from a cached prefix or
    not) replay on the worker, which keeps its own copy of every cached prefix's tail under rank
    0's key; the tokens equal the single-process engine's, and both ranks' caches, tails included,
    are bit for bit the same. The pool is small enough that prefixes are evicted, and their tails
    dropped on both ranks."""
    pytest.importorskip("kivi_ops.cache.paged")
    tokenizer = tiny[1]
    system = tokenizer(" ".join(["The quick brown fox jumps over the lazy dog."] * 3))["input_ids"]
    prompts = [tokenizer.decode(system + tokenizer(p)["input_ids"]) for p in PROMPTS]
    paging = PagedServing(24, 4, prefix_chunk=8, max_prefixes=6)
    want, got, stats, engine, channel = serve_alone_and_tp(tiny, "kivi", paging, prompts)
    assert got == want
    assert stats["prefix_hits"] > 0 and engine.snapshot()["evictions"] > 0, stats
    ops = collections_of(channel.plans)
    assert ops["prefills"] == ops["chunked"] == len(prompts)
    assert_same_cache(engine.runner, channel.runner)
    tails = {prefix.payload for prefix in engine.placement.blocks.prefixes.values()}
    assert engine.runner.saved.keys() == channel.runner.saved.keys() == tails  # evicted ones dropped on both
    for key in tails:
        ours, theirs = engine.runner.saved[key], channel.runner.saved[key]
        assert ours.num_pages == theirs.num_pages and ours.saved.keys() == theirs.saved.keys()
        assert all(torch.equal(ours.saved[k], theirs.saved[k]) for k in ours.saved)


def collections_of(sent) -> dict:
    """How many items of each Plan field the plans carried (chunked: the prefills in chunks)."""
    counts = {name: 0 for name in ("swap_out", "swap_in", "prefills", "drops", "moves", "table")}
    for s in sent:
        for name in counts:
            counts[name] += len(getattr(s.plan, name))
    counts["chunked"] = sum(p.chunk > 0 for s in sent for p in s.plan.prefills)
    return counts


def test_a_worker_refuses_a_plan_out_of_order(tiny):
    model, _ = tiny
    worker = Worker(Runner(model, method="fp", kivi_config=None, slots=2, max_seq_len=32))
    assert worker.apply(Sent(PLAN, 0)) is True
    with pytest.raises(OutOfStep, match="expected plan 1, got plan 2"):
        worker.apply(Sent(PLAN, 2))
    assert worker.apply(Sent(STOP, 1)) is False


def test_ranks_that_built_different_caches_are_refused_at_start(tiny):
    model, _ = tiny
    worker = Runner(model, method="fp", kivi_config=None, slots=3, max_seq_len=32)  # rank 1 got other flags
    with pytest.raises(ValueError, match=r"different caches .*\[\[2, 0, 0\], \[3, 0, 0\]\].*same flags"):
        LeaderRunner(model, channel=Loopback(worker), timeout_s=60, method="fp", kivi_config=None, slots=2,
                     max_seq_len=32)


def test_an_idle_leader_sends_heartbeats(tiny):
    start = time.monotonic()
    engine, channel = tp_engine(tiny, "fp", slots=2, timeout_s=0.4)  # a heartbeat every 0.1 s
    try:
        deadline = start + 30
        while sum(not s.plan.decode for s in channel.plans) < 5 and time.monotonic() < deadline:
            time.sleep(0.01)
        elapsed = time.monotonic() - start
        plans = list(channel.plans)
    finally:
        engine.close()
    # First the warm-up, one decode step per bucket; its end tells every rank to stop compiling, in the
    # plan after it; then heartbeats alone.
    steps = [s for s in plans if s.plan.decode]
    assert len(steps) == len(engine.placement.buckets) and plans[:len(steps)] == steps
    first, *beats = plans[len(steps):]
    assert first.plan == Plan(stop_compiling=True)
    assert 3 <= len(beats) <= elapsed / 0.1 + 1, (len(beats), elapsed)  # not more often than every 0.1 s
    assert all(s.kind == PLAN and s.plan == Plan() for s in beats)


def test_a_dead_rank_ends_open_requests_with_503_and_refuses_new_ones(tiny):
    from fastapi.testclient import TestClient

    from kivi_serve.app import build_app

    engine, channel = tp_engine(tiny, "kivi", slots=2, fail_after=6)  # a few steps, then the peer is gone
    events, ended = [], threading.Event()

    def emit(kind, payload):
        events.append((kind, payload))
        if kind in ("done", "error"):
            ended.set()

    try:
        ids = engine.tokenizer(PROMPTS[0])["input_ids"]
        engine.submit(Request(prompt_ids=ids, max_tokens=40, temperature=0, emit=emit))
        assert ended.wait(30), "the request hung"
        kind, failure = events[-1]
        assert kind == "error" and failure.status == 503 and failure.code == "tensor_parallel_failure"
        assert "Connection reset by peer" in failure.message
        assert 0 < sum(k == "text" for k, _ in events) < 40
        with pytest.raises(RequestError, match="cannot serve") as refused:
            engine.submit(Request(prompt_ids=ids, max_tokens=4, emit=emit))
        assert refused.value.status == 503 and refused.value.code == "tensor_parallel_failure"
        client = TestClient(build_app(engine))
        health = client.get("/health")
        assert health.status_code == 503 and health.json()["error"]["code"] == "tensor_parallel_failure"
        r = client.post("/v1/completions", json={"model": "tiny", "prompt": "Hi", "max_tokens": 2})
        assert r.status_code == 503 and r.json()["error"]["code"] == "tensor_parallel_failure"
        engine.thread.join(10)
        assert not engine.thread.is_alive()  # the engine stopped; nothing waits on the dead rank
    finally:
        engine.close()


@pytest.mark.parametrize("value", ["0", "-1", "nan"])
def test_a_tp_timeout_that_is_not_a_positive_number_is_a_usage_error(value, capsys):
    from kivi_cli.main import main

    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--tp-timeout", value])
    assert exit_info.value.code == 2
    assert "--tp-timeout: must be a finite number > 0" in capsys.readouterr().err
