"""What every serve test needs, once: a port nothing else will take, uvicorn in a thread, and a tiny
engine (a random Llama with the embedded model's tokenizer; a step takes milliseconds; EOS off, so
every request runs to max_tokens) with the helpers that drive it through its public surface
(submit, stats, snapshot, check) and compare it with `kivi generate`.

free_port picks below the OS's ephemeral range. A port taken with bind(("127.0.0.1", 0)) and
released comes from that range, which the OS hands to every other bind(0) too: in CI, torchrun's
rendezvous store got the port a test had just picked for `kivi serve`, and the server failed with
"address already in use" (stop 45). Below the range, only another test's free_port can collide, and
it picks at random among ~20K ports and checks that the port binds.
"""

from __future__ import annotations

import contextlib
import random
import socket
import threading
import time
from pathlib import Path

import httpx
import pytest

from kivi_models import generate, make_cache, patch_model
from kivi_ops import KIVIConfig
from kivi_serve.app import build_app
from kivi_serve.config import ServeConfig
from kivi_serve.engine import Engine
from kivi_serve.paged_options import PagedServing
from kivi_serve.request import Request

_PORT_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def free_port() -> int:
    """A port on 127.0.0.1 that binds now and that the OS will not hand out to a bind(0)."""
    ephemeral_low = int(_PORT_RANGE.read_text().split()[0]) if _PORT_RANGE.exists() else 32768
    if ephemeral_low <= 11000:  # an unusual range: no room below it, fall back to the OS's choice
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]
    for _ in range(200):
        port = random.randrange(10000, ephemeral_low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in 10000..{ephemeral_low} after 200 tries")


@contextlib.contextmanager
def uvicorn_in_thread(server, timeout_s: float = 30):
    """Runs a uvicorn.Server (configured for 127.0.0.1) in a daemon thread; yields its URL once it
    listens, and stops it afterwards. Whether the engine behind it is ready is the caller's to wait for."""
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.time() + timeout_s
    while not server.started:
        assert time.time() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{server.config.port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


# ---------------------------------------------------------------- the tiny engine

NAME = "tiny"
CONFIG = KIVIConfig(group_size=4, residual_length=8)
MAX_SEQ_LEN = 96
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Water boils at", "Once upon a time",
           "The three primary colors are"]
LENGTHS = [30, 22, 26, 18, 24]
METHODS = ["fp", "kivi"]


@pytest.fixture(scope="module")
def tiny():
    from transformers import AutoTokenizer

    from kivi_models.loading import default_model_dir
    from tiny_models import tiny_llama

    tokenizer = AutoTokenizer.from_pretrained(default_model_dir(), local_files_only=True)
    return patch_model(tiny_llama(vocab_size=len(tokenizer), max_position_embeddings=256)), tokenizer


def make_engine(tiny, method, num_pages, page_size=None, slots=4, prefix_chunk=None, prefix_cache_size=256,
                prefix_cache_bytes=None, **options) -> Engine:
    model, tokenizer = tiny
    paging = PagedServing(num_pages, page_size, prefix_chunk, prefix_cache_size, options.pop("decode_buckets", None),
                          prefix_cache_bytes)
    config = ServeConfig(method=method, kivi_config=CONFIG, slots=slots, max_seq_len=MAX_SEQ_LEN, paging=paging,
                         eos_token_ids=set(), served_model_name=NAME, **options)
    return Engine(model, tokenizer, config)


def complete_all(engine, prompts, lengths, steps_apart=0) -> list[list[int]]:
    """Submit greedy requests and wait for them: each one's token ids. steps_apart: each request
    is submitted once the engine has run that many decode steps since the previous one (arrivals
    counted in the engine's steps, not in seconds, so requests overlap alike on a fast machine
    and a slow one; a second without a step submits anyway, so an idle engine cannot stall it)."""
    tokenizer = engine.tokenizer
    done = [threading.Event() for _ in prompts]
    reqs = []
    for i, (p, n) in enumerate(zip(prompts, lengths)):
        def emit(kind, payload, i=i):
            if kind == "error":
                raise AssertionError(f"request {i} failed: {payload}")
            if kind == "done":
                done[i].set()
        reqs.append(Request(prompt_ids=tokenizer(p)["input_ids"], max_tokens=n, temperature=0, emit=emit))
    stepped, steps = threading.Condition(), [0]
    real_decode = engine.runner.decode

    def counted(*args, **kwargs):
        out = real_decode(*args, **kwargs)
        with stepped:
            steps[0] += 1
            stepped.notify_all()
        return out

    engine.runner.decode = counted
    try:
        for i, r in enumerate(reqs):
            if i:
                with stepped:
                    start = steps[0]
                    stepped.wait_for(lambda: steps[0] >= start + steps_apart, timeout=1.0)
            engine.submit(r)
        for i, d in enumerate(done):
            assert d.wait(120), f"request {i} never finished: {engine.stats()}"
    finally:
        engine.runner.decode = real_decode
    return [r.tokens for r in reqs]


def alone(tiny, method, prompt: str, max_tokens: int) -> list[int]:
    """`kivi generate`: the prompt alone in a static batch-1 cache, greedy."""
    model, tokenizer = tiny
    ids = tokenizer(prompt)["input_ids"]
    cache = make_cache(model, method=method, batch_size=1, max_seq_len=len(ids) + max_tokens, kivi_config=CONFIG)
    return generate(model, [ids], max_new_tokens=max_tokens, cache=cache).tokens[0]


def wait_idle(engine, timeout=10.0) -> dict:
    end = time.time() + timeout
    while time.time() < end:
        s = engine.stats()
        if s["slots_used"] == 0 and s["waiting"] == 0 and s["swapped"] == 0:
            return s
        time.sleep(0.01)
    raise AssertionError(f"never idle: {engine.stats()}")


@contextlib.contextmanager
def serving(engine):
    import uvicorn

    srv = uvicorn.Server(uvicorn.Config(build_app(engine), host="127.0.0.1", port=free_port(),
                                        log_level="warning"))
    with uvicorn_in_thread(srv) as url:
        deadline = time.time() + 300
        while not engine.ready.is_set():
            assert time.time() < deadline, "the engine did not get ready"
            time.sleep(0.02)
        yield url


def metrics(url) -> dict:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return {line.split()[0]: float(line.split()[1]) for line in text.splitlines() if line and not line.startswith("#")}
