"""`kivi serve` as operators need it (issue 53): a request that arrived whole is never timed out by
--read-timeout, malformed or oversized bodies get the JSON error shape a client can read, a stuck
engine step shows on /health and /metrics and waiting requests still get their 504, and a fault
names the step that failed.

The real thing (uvicorn on 127.0.0.1 with `kivi serve`'s connection protocol, Python's urllib, httpx,
raw sockets) over the tiny random Llama of serve_fixtures; decode steps are slowed (or stalled) by
wrapping the runner's step function."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
import urllib.error
import urllib.request
from dataclasses import replace

import httpx
import pytest

from kivi_serve.app import build_app
from kivi_serve.connections import ConnectionLimits, uvicorn_config
from kivi_serve.request import Request
from serve_fixtures import NAME, PROMPTS, alone, free_port, make_engine, tiny, uvicorn_in_thread, wait_idle  # noqa: F401


@contextlib.contextmanager
def serving(engine, limits: ConnectionLimits, **app_options):
    """uvicorn as `kivi serve` configures it (its protocol, the limits), once the engine is ready."""
    import uvicorn

    srv = uvicorn.Server(uvicorn_config(build_app(engine, replace(engine.config, **app_options)), host="127.0.0.1", port=free_port(),
                                        limits=limits))
    with uvicorn_in_thread(srv) as url:
        assert engine.ready.wait(300), "the engine did not get ready"
        yield url


@contextlib.contextmanager
def slow_steps(engine, seconds: float):
    real = engine.step_fn

    def slow(*args, **kwargs):
        time.sleep(seconds)
        return real(*args, **kwargs)

    engine.step_fn = slow
    try:
        yield
    finally:
        engine.step_fn = real


def urllib_post(url: str, body: dict, timeout: float = 60) -> tuple[int, dict]:
    """POST with Python's urllib, which sends `Connection: close`: (status, JSON body)."""
    req = urllib.request.Request(f"{url}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


# ---------------------------------------------------------------- item 1: no 408 once a request is whole


@pytest.mark.parametrize("client", ["urllib", "keep-alive"])
def test_requests_that_arrived_whole_are_never_timed_out_queued_preempted_or_long(tiny, client):
    # A pool for one request at a time (6 pages of 4 tokens; each needs 5) and 2 rows: of 3 concurrent
    # requests one runs, one is preempted (swapped out) and one waits for a row; each takes 12 slowed
    # steps, past the 0.1-s read timeout. At 1adfb4f every urllib request got 408 (h11 says
    # MUST_CLOSE, not DONE, once a `Connection: close` request has arrived).
    engine = make_engine(tiny, "fp", num_pages=6, page_size=4, slots=2)
    body = {"model": NAME, "prompt": PROMPTS[0], "max_tokens": 12, "temperature": 0}
    results, seen = [None] * 3, {"waiting": 0, "swapped": 0}
    try:
        with serving(engine, ConnectionLimits(16, timeout_keep_alive=30, read_timeout=0.1)) as url, \
                slow_steps(engine, 0.01), httpx.Client(timeout=60) as keep_alive:
            def send(i):
                if client == "urllib":
                    results[i] = urllib_post(url, body)
                else:
                    r = keep_alive.post(f"{url}/v1/completions", json=body)
                    results[i] = r.status_code, r.json()

            threads = [threading.Thread(target=send, args=(i,)) for i in range(3)]
            for t in threads:
                t.start()
            while any(t.is_alive() for t in threads):
                s = engine.stats()
                seen = {k: max(seen[k], s[k]) for k in seen}
                time.sleep(0.01)
            assert all(status == 200 for status, _ in results), results
            assert [r["usage"]["completion_tokens"] for _, r in results] == [12] * 3
            stats = wait_idle(engine)
        assert stats["preemptions"] >= 1 and seen["swapped"] >= 1 and seen["waiting"] >= 1, (stats, seen)
    finally:
        engine.close()


# ---------------------------------------------------------------- item 2: a signal during start-up

# `kivi serve` over the tiny model (load_model replaced), its warm-up held in a step that takes
# 120 s, as a compile of a large model may: argv[1] is the port.
SERVE_WARMING_UP = """
import sys, time
from transformers import AutoTokenizer
import kivi_cli.serve as cli_serve
import kivi_serve.runner as runner
from kivi_cli.main import main
from kivi_models import patch_model
from kivi_models.loading import default_model_dir
from tiny_models import tiny_llama

tokenizer = AutoTokenizer.from_pretrained(default_model_dir(), local_files_only=True)
model = tiny_llama(vocab_size=len(tokenizer), max_position_embeddings=256)
cli_serve.load_model = lambda *args, **kwargs: (model, tokenizer)
runner.decode_step = lambda *args, **kwargs: time.sleep(120)
sys.exit(main(["serve", "--port", sys.argv[1], "--paged", "--method", "kivi", "--max-seq-len", "128"]))
"""


def start_serve(tmp_path, argv: list[str]):
    import os
    import subprocess
    import sys
    from pathlib import Path

    tests = str(Path(__file__).parent)
    path = os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), tests]))  # one given first (old code)
    log = (tmp_path / "serve.log").open("w")
    return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=tests, env={**os.environ, "PYTHONPATH": path})


def signal_while_not_ready(proc, port: int, tmp_path, sig) -> tuple[int, float, str]:
    """Send `sig` once /health says not_ready: the exit status, the seconds it took, the log."""
    try:
        wait_not_ready(proc, f"http://127.0.0.1:{port}", tmp_path / "serve.log")
        start = time.perf_counter()
        proc.send_signal(sig)
        status = proc.wait(timeout=60)
        took = time.perf_counter() - start
    finally:
        if proc.poll() is None:
            proc.kill()
    return status, took, (tmp_path / "serve.log").read_text()


def wait_not_ready(proc, url: str, log_path, timeout: float = 180) -> None:
    """Until /health answers 503 not_ready (the server listens, its engine warms up)."""
    end = time.time() + timeout
    while time.time() < end:
        assert proc.poll() is None, log_path.read_text()
        with contextlib.suppress(httpx.HTTPError):
            r = httpx.get(f"{url}/health", timeout=2)
            assert r.status_code == 503 and r.json()["error"]["code"] == "not_ready", r.text
            return
        time.sleep(0.1)
    raise AssertionError(f"the server never answered: {log_path.read_text()}")


@pytest.mark.slow  # a server process (about 10 s)
@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT"])
def test_a_signal_during_warm_up_ends_the_process_at_once_with_status_0(tmp_path, sig):
    # At 1adfb4f the process waited 30 s for the engine thread ("did not stop within 30 s of
    # close()"), then exited; with torch's C++ on that thread's stack, it aborted (SIGABRT, -6).
    import signal
    import sys

    port = free_port()
    proc = start_serve(tmp_path, [sys.executable, "-c", SERVE_WARMING_UP, str(port)])
    status, took, log = signal_while_not_ready(proc, port, tmp_path, getattr(signal, sig))
    assert status == 0 and took < 5, (status, took, log)
    assert "Traceback" not in log and "terminate called" not in log, log


@pytest.mark.slow  # the embedded model's `kivi serve` (loading, then SIGTERM mid-compile: about 20 s)
def test_kivi_serve_sigterm_while_compiling_its_warm_up_exits_0_promptly(tmp_path):
    """The issue's case: the real CLI with the embedded model, SIGTERM while /health says not_ready."""
    import signal
    import sys
    from pathlib import Path

    port = free_port()
    kivi = str(Path(sys.executable).parent / "kivi")
    proc = start_serve(tmp_path, [kivi, "serve", "--port", str(port), "--paged", "--method", "kivi", "--max-seq-len",
                                  "1024"])
    status, took, log = signal_while_not_ready(proc, port, tmp_path, signal.SIGTERM)
    assert status == 0 and took < 15, (status, took, log)
    assert "terminate called" not in log and "Traceback" not in log, log


# ---------------------------------------------------------------- item 3: a stuck step is visible


def metric(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return next(float(line.split()[1]) for line in text.splitlines() if line.startswith(f"{name} "))


def test_a_hung_step_turns_health_503_and_waiting_requests_still_get_their_504_on_time(tiny):
    # At 1adfb4f /health said ok throughout a hung step, and --request-timeout waited for the step.
    engine = make_engine(tiny, "fp", num_pages=64, slots=2, stall_timeout=0.3, request_timeout=1.0)
    real, release = engine.step_fn, threading.Event()

    def hung(*args, **kwargs):
        release.wait(30)
        return real(*args, **kwargs)

    body = {"model": NAME, "prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0}
    try:
        with serving(engine, ConnectionLimits(16)) as url:
            assert httpx.get(f"{url}/health", timeout=10).status_code == 200
            assert metric(url, "kivi_engine_stalled") == 0
            engine.step_fn = hung
            answers = {}

            def send(name, stream):
                start = time.perf_counter()
                r = httpx.post(f"{url}/v1/completions", json={**body, "stream": stream}, timeout=30)
                answers[name] = (r, time.perf_counter() - start)

            threads = [threading.Thread(target=send, args=(n, n == "stream")) for n in ("stream", "whole", "queued")]
            for t in threads:
                t.start()
                time.sleep(0.05)
            end = time.perf_counter() + 10
            while (h := httpx.get(f"{url}/health", timeout=10)).status_code == 200:
                assert time.perf_counter() < end, "health never turned 503"
                time.sleep(0.05)
            err = h.json()["error"]
            assert h.status_code == 503 and err["code"] == "engine_stalled" and "--stall-timeout" in err["message"]
            assert metric(url, "kivi_engine_stalled") == 1
            for t in threads:
                t.join(timeout=10)
            # each got its 504 about 1 s after it came, while the step still hangs
            assert not release.is_set() and set(answers) == {"stream", "whole", "queued"}
            for name, (r, took) in answers.items():
                assert took < 2.5, (name, took)
                if name == "stream":
                    events = [line for line in r.text.splitlines() if line]
                    assert '"code":"timeout"' in events[-2] and events[-1] == "data: [DONE]", events
                else:
                    assert r.status_code == 504 and r.json()["error"]["code"] == "timeout", r.text
            release.set()
            wait_idle(engine)
            assert httpx.get(f"{url}/health", timeout=10).status_code == 200
            assert metric(url, "kivi_engine_stalled") == 0
            engine.step_fn, engine.request_timeout = real, None  # a loaded machine may take 1 s for 8 tokens
            assert httpx.post(f"{url}/v1/completions", json=body, timeout=30).status_code == 200
            engine.check()
    finally:
        release.set()
        engine.close()


@pytest.mark.parametrize("seconds", [0, -1, float("nan"), float("inf")])
def test_the_stall_timeout_must_be_a_finite_positive_number(tiny, seconds):
    with pytest.raises(ValueError, match=r"stall_timeout \(--stall-timeout\) must be a finite number"):
        make_engine(tiny, "fp", num_pages=8, stall_timeout=seconds)


# ---------------------------------------------------------------- item 4: a fault names its step


def test_a_swap_in_that_fails_is_reported_as_such_and_ends_that_request_alone(tiny):
    # At 1adfb4f a failing swap-in was "the decode step failed" and ended every running request.
    ids = tiny[1](PROMPTS[0])["input_ids"]
    want = alone(tiny, "fp", PROMPTS[0], 30)
    engine = make_engine(tiny, "fp", num_pages=10, page_size=4, slots=2)  # a pool for one: one is preempted

    def load(*args):
        raise MemoryError("injected: the host copy is unreadable")

    engine.runner.load = load
    try:
        events = [[], []]
        reqs = [Request(prompt_ids=ids, max_tokens=30, temperature=0, emit=lambda k, p, i=i: events[i].append((k, p)))
                for i in range(2)]
        for r in reqs:
            engine.submit(r)
        s = wait_idle(engine)
    finally:
        engine.close()
    assert s["preemptions"] >= 1
    last = sorted((e[-1][0], i) for i, e in enumerate(events))
    assert [kind for kind, _ in last] == ["done", "error"], events
    message = events[last[1][1]][-1][1].message
    assert "swapping it back in from host memory failed: MemoryError" in message and "decode" not in message
    assert reqs[last[0][1]].tokens == want
    assert engine.runner.saved == {} and s["pages_used"] == 0 and s["swapped"] == 0
    engine.check()


def test_a_failure_no_request_owns_names_the_step_that_failed(tiny):
    engine = make_engine(tiny, "fp", num_pages=64, slots=2)

    def write_table(*args):
        raise RuntimeError("injected table fault")

    engine.runner.write_table = write_table
    try:
        events = []
        engine.submit(Request(prompt_ids=[1, 2, 3], max_tokens=4, emit=lambda *e: events.append(e)))
        wait_idle(engine)
    finally:
        engine.close()
    assert events[-1][0] == "error", events
    assert events[-1][1].message == "writing the block table failed: RuntimeError: injected table fault"


# ---------------------------------------------------------------- item 10: malformed and oversized bodies


@pytest.fixture(scope="module")
def server(tiny):
    engine = make_engine(tiny, "fp", num_pages=64, slots=2)
    with serving(engine, ConnectionLimits(16, timeout_keep_alive=5, read_timeout=5)) as url:
        yield url
    engine.close()


def raw_exchange(url: str, data: bytes, timeout: float = 10) -> bytes:
    """Send `data` on a new connection; what the server sends until it closes the connection."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=timeout) as sock:
        sock.sendall(data)
        received = b""
        with contextlib.suppress(ConnectionResetError):
            while chunk := sock.recv(65536):
                received += chunk
    return received


@pytest.mark.parametrize("length", [b"1e23", b"-1", b"12abc"])
def test_a_malformed_content_length_gets_the_json_error_shape(server, length):
    # At 1adfb4f: h11's "Invalid HTTP request received." in text/plain.
    data = raw_exchange(server, b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\ncontent-type: application/json\r\n"
                                b"Content-Length: " + length + b"\r\n\r\n{}")
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400 ") and b"content-type: application/json" in head.lower(), data
    assert json.loads(body)["error"]["code"] == "invalid_http_request"


def test_a_30_mb_body_lets_urllib_read_its_413(server):
    # At 1adfb4f the 413 was sent before the body was read and the connection closed under urllib's
    # sendall (ConnectionResetError / BrokenPipeError instead of an answer).
    body = {"model": NAME, "prompt": "x" * (30 << 20), "max_tokens": 1}
    status, answer = urllib_post(server, body)
    assert status == 413 and answer["error"]["code"] == "request_too_large", answer
    assert httpx.get(f"{server}/health", timeout=10).status_code == 200


def test_an_oversize_body_behind_expect_100_continue_is_refused_without_waiting_for_it(server):
    start = time.perf_counter()
    data = raw_exchange(server, b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\ncontent-type: application/json\r\n"
                                b"Expect: 100-continue\r\nContent-Length: 31457280\r\n\r\n")
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 413 ") and json.loads(body)["error"]["code"] == "request_too_large", data
    assert time.perf_counter() - start < 3  # not the 5-s read timeout


# ---------------------------------------------------------------- item 5: the equality rule


@pytest.mark.slow  # the paged KIVI kernels' warm-up and three prompts of 30+ tokens (about 20 s here)
def test_without_prefix_caching_prompts_longer_than_r_equal_kivi_generate(tiny):
    # The flag docs/serve.md gives to restore the equality: paged, prompts of 2R-5R tokens, one-shot prefills.
    from kivi_models import generate, make_cache
    from serve_fixtures import CONFIG, complete_all

    model, tokenizer = tiny
    prompts = [" ".join(PROMPTS[i:] + PROMPTS[:i]) for i in range(3)]
    lengths = [12, 9, 14]
    engine = make_engine(tiny, "kivi", num_pages=96, page_size=4, slots=3)  # prefix_chunk None: --no-prefix-caching
    try:
        got = complete_all(engine, prompts, lengths, steps_apart=2)
    finally:
        engine.close()
    for prompt, n, tokens in zip(prompts, lengths, got):
        ids = tokenizer(prompt)["input_ids"]
        assert len(ids) > 2 * CONFIG.residual_length
        cache = make_cache(model, method="kivi", batch_size=1, max_seq_len=len(ids) + n, kivi_config=CONFIG)
        assert tokens == generate(model, [ids], max_new_tokens=n, cache=cache).tokens[0]


def test_the_docs_and_the_help_state_when_a_completion_equals_kivi_generate():
    import re
    from pathlib import Path

    from kivi_cli.main import build_parser

    doc = (Path(__file__).resolve().parent.parent / "docs" / "serve.md").read_text()
    rule = doc[doc.index("## What continuous batching does"):doc.index("### No compile after ready")]
    assert re.search(r"equals `kivi generate`[^.]*prompt alone when prompts are prefilled in one shot: with\s+"
                     r"`--no-prefix-caching`", rule), rule
    assert "a prompt of R tokens or more" in rule and "shorter than R tokens" in rule
    operations = doc[doc.index("## Operations"):doc.index("## Measured")]
    for section in ("### Health, the watchdog and fail-fast", "### Restart", "### What a completion equals"):
        assert section in operations
    serve = build_parser()._subparsers._group_actions[0].choices["serve"]
    (flag,) = [a for a in serve._actions if "--prefix-caching" in a.option_strings]
    assert "--no-prefix-caching: they equal them" in flag.help


SERVE_LOADING = SERVE_WARMING_UP.replace(
    "cli_serve.load_model = lambda *args, **kwargs: (model, tokenizer)",
    "cli_serve.load_model = lambda *args, **kwargs: (print('loading', flush=True), time.sleep(120))")


@pytest.mark.slow  # a process that imports torch and the tokenizer (about 5 s)
def test_ctrl_c_while_the_model_loads_is_one_line_and_status_130(tmp_path):
    import signal
    import sys

    proc = start_serve(tmp_path, [sys.executable, "-c", SERVE_LOADING, str(free_port())])
    log_path = tmp_path / "serve.log"
    try:
        end = time.time() + 120
        while "loading" not in log_path.read_text():
            assert proc.poll() is None and time.time() < end, log_path.read_text()
            time.sleep(0.1)
        proc.send_signal(signal.SIGINT)
        status = proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    log = log_path.read_text()
    assert status == 130 and "Traceback" not in log and "interrupted while starting" in log, (status, log)


class _StuckEngine:
    """An engine whose thread never stops (a compile or a hung step): close() times out, or is
    interrupted by a Ctrl-C while it waits."""

    def __init__(self, interrupt: bool = False):
        self.ready, self.interrupt = threading.Event(), interrupt

    def close(self, timeout):
        if self.interrupt:
            raise KeyboardInterrupt
        return False


class _Exited(Exception):
    pass


@pytest.fixture
def exits(monkeypatch):
    import kivi_cli.serve as cli_serve

    def exit_(status):
        raise _Exited(status)

    monkeypatch.setattr(cli_serve.os, "_exit", exit_)
    return cli_serve.stop_engine


def test_an_error_that_ends_serving_is_printed_before_the_process_leaves_a_stuck_engine(exits, capsys):
    with pytest.raises(_Exited) as left:
        try:
            raise OSError("address already in use")
        except OSError:
            exits(_StuckEngine())
    assert left.value.args == (1,)
    assert "OSError: address already in use" in capsys.readouterr().err


def test_ctrl_c_while_waiting_for_a_stuck_engine_leaves_with_status_130(exits):
    with pytest.raises(_Exited) as left:
        exits(_StuckEngine(interrupt=True))
    assert left.value.args == (130,)
