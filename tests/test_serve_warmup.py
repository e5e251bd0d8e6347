"""`kivi serve` without --compile compiles before it says ready, and never while it serves (issue 43,
item 6): the engine's warm-up runs a decode step per bucket, which compiles the per-op CPU kernels
(kivi_ops/dispatch/cpu_compiled.py) of those shapes; /health answers 503 until it ends. Afterwards
the engine thread compiles nothing: a new prompt shape (a one-token prompt, a last chunk of one
token) runs the reference ops, and a running stream sees no gap of a compile's seconds.

The suite runs the reference kernels (conftest.py); these tests select the compiled ones, as a user
gets them."""

from __future__ import annotations

import contextlib
import threading
import time

import httpx
import pytest
import torch

from kivi_ops import dispatch
from kivi_ops.dispatch import cpu_compiled
from serve_fixtures import free_port, uvicorn_in_thread
from serve_fixtures import make_engine, tiny  # noqa: F401

CHUNK = 8  # the prefix chunk (2 pages of 4 tokens)
MAX_GAP_S = 1.0  # a decode step of the tiny model takes milliseconds; a per-op compile takes seconds


def compiles() -> int:
    """Per-op compiles this process has started so far (each a new signature)."""
    return cpu_compiled._compiled.cache_info().misses


@pytest.fixture
def gated_warm_up(monkeypatch):
    """The engine's decode step waits for the returned event on its first call (the warm-up)."""
    import kivi_serve.runner as serve_runner

    release, real = threading.Event(), serve_runner.decode_step
    release.rows = []  # the rows of each step, in order

    def decode_step(model, cache, tokens, *args, **kwargs):
        assert release.wait(60)
        release.rows.append(len(tokens))
        return real(model, cache, tokens, *args, **kwargs)

    monkeypatch.setattr(serve_runner, "decode_step", decode_step)
    yield release
    release.set()


def text_of(tokenizer, n: int) -> str:
    """A prompt of exactly n tokens."""
    text = "a" + " a" * (n - 1)
    assert len(tokenizer(text)["input_ids"]) == n
    return text


def stream_times(url: str, prompt: str, max_tokens: int, times: list[float]) -> None:
    """A greedy streamed completion; appends the arrival time of each event that carries text."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {") and '"text":""' not in line:
                times.append(time.perf_counter())


def wait_ready(url: str, timeout: float = 600) -> bool:
    deadline = time.time() + timeout
    while httpx.get(f"{url}/health", timeout=10).status_code != 200:
        if time.time() > deadline:
            return False
        time.sleep(0.05)
    return True


@contextlib.contextmanager
def started(engine):
    """uvicorn on 127.0.0.1 in front of the engine, without waiting for the engine to be ready."""
    import uvicorn

    from kivi_serve.app import build_app

    srv = uvicorn.Server(uvicorn.Config(build_app(engine), host="127.0.0.1", port=free_port(),
                                        log_level="warning"))
    try:
        with uvicorn_in_thread(srv) as url:
            yield url
    finally:
        engine.close()


def test_health_is_not_ready_until_the_warm_up_has_run_every_bucket(tiny, gated_warm_up):  # noqa: F811
    """Without --compile too (the reference kernels here: cheap); buckets 2 and 4."""
    engine = make_engine(tiny, "kivi", 24, page_size=4, decode_buckets=(2,))
    with started(engine) as url:
        health = httpx.get(f"{url}/health", timeout=10)
        assert health.status_code == 503 and health.json()["error"]["code"] == "not_ready"
        gated_warm_up.set()
        assert wait_ready(url)
        assert gated_warm_up.rows == [2, 4]  # one step per bucket, before ready


@pytest.mark.slow  # compiles the per-op kernels of one bucket (tens of seconds on a busy 2-core machine)
def test_ready_after_the_kernels_compile_and_a_stream_never_waits_for_a_compile(tiny, gated_warm_up):  # noqa: F811
    # One thread: with two on a machine shared with other work, OpenMP's barriers made every step
    # of this tiny model take ~1 s (measured); the gaps measured here are the engine's own.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with dispatch.cpu_kernels("compiled"), \
                started(make_engine(tiny, "kivi", 96, page_size=4, prefix_chunk=CHUNK)) as url:  # roomy: no preemption
            health = httpx.get(f"{url}/health", timeout=10)  # the warm-up is held at its first step
            assert health.status_code == 503 and health.json()["error"]["code"] == "not_ready"
            before = compiles()
            gated_warm_up.set()
            assert wait_ready(url)
            assert compiles() > before  # the warm-up compiled the decode bucket's kernels ...
            warm = compiles()

            times: list[float] = []
            stream = threading.Thread(target=stream_times, args=(url, text_of(tiny[1], 11), 60, times))
            stream.start()
            while len(times) < 3 and stream.is_alive():
                time.sleep(0.01)
            # New prompt shapes while it streams: one token (a one-token prefill), 9 and 17 tokens (a
            # last chunk of one token after whole chunks), 5 and 13 (other partial chunks).
            for n in (1, 9, 17, 5, 13):
                body = {"model": "tiny", "prompt": text_of(tiny[1], n), "max_tokens": 3, "temperature": 0}
                assert httpx.post(f"{url}/v1/completions", json=body, timeout=120).status_code == 200
            stream.join(timeout=120)
            assert not stream.is_alive() and len(times) > 10
            gaps = [b - a for a, b in zip(times, times[1:])]
            assert max(gaps) < MAX_GAP_S, max(gaps)
            assert compiles() == warm  # ... and nothing compiled after ready
    finally:
        torch.set_num_threads(threads)


def test_stop_compiling_is_per_thread():
    seen = []
    worker = threading.Thread(target=lambda: (cpu_compiled.stop_compiling_on_this_thread(),
                                              seen.append(cpu_compiled.compiles_on_this_thread())))
    worker.start()
    worker.join()
    assert seen == [False] and cpu_compiled.compiles_on_this_thread()
