"""`kivi serve` against the real thing: uvicorn on 127.0.0.1 and a free port, the official openai
client, concurrent and streamed requests, bad requests, a disconnect, a bounded load test."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
import torch

from kivi_models import generate, load_model, make_cache, patch_model
from kivi_serve.app import build_app
from kivi_serve.config import ServeConfig
from kivi_serve.engine import Engine
from kivi_ops import KIVIConfig
from serve_fixtures import free_port, metrics, uvicorn_in_thread

NAME = "smollm2-test"
CONFIG = KIVIConfig(group_size=8, residual_length=8)  # flushes within short completions
SLOTS, MAX_SEQ_LEN = 3, 96
HEALTH = []  # what /health answered while the server fixture started
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Water boils at a temperature of",
           "The three primary colors are", "Once upon a time"]


@pytest.fixture(scope="module")
def server():
    import uvicorn

    model, tokenizer = load_model()
    patch_model(model)
    torch._dynamo.utils.counters.clear()
    engine = Engine(model, tokenizer, ServeConfig(method="kivi", kivi_config=CONFIG, slots=SLOTS, max_seq_len=MAX_SEQ_LEN,
                                                  compile=True, served_model_name=NAME))
    srv = uvicorn.Server(uvicorn.Config(build_app(engine), host="127.0.0.1", port=free_port(), log_level="warning"))
    with uvicorn_in_thread(srv) as url:
        deadline = time.time() + 600
        while time.time() < deadline:  # uvicorn starts at once; the engine compiles its step meanwhile
            try:
                status = httpx.get(f"{url}/health", timeout=1).status_code
            except httpx.HTTPError:
                status = None
            if status is not None:  # (/health's status, compiled graphs by then)
                HEALTH.append((status, torch._dynamo.utils.counters["stats"]["unique_graphs"]))
            if status == 200:
                break
            time.sleep(0.05)
        yield url, engine, model, tokenizer
    engine.close()


def client(url):
    from openai import OpenAI

    return OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=120, max_retries=0)


def alone(model, tokenizer, prompt: str, max_tokens: int) -> str:
    """`kivi generate`'s answer: the prompt alone in a batch-1 cache with the same settings."""
    ids = tokenizer(prompt)["input_ids"]
    cache = make_cache(model, method="kivi", batch_size=1, max_seq_len=len(ids) + max_tokens, kivi_config=CONFIG)
    result = generate(model, [ids], max_new_tokens=max_tokens, cache=cache, eos_token_id=tokenizer.eos_token_id)
    return tokenizer.decode([t for t in result.tokens[0] if t != tokenizer.eos_token_id], skip_special_tokens=True)


def wait_idle(url, timeout=60) -> dict:
    end = time.time() + timeout
    while time.time() < end:
        m = metrics(url)
        if m["kivi_cache_slots_used"] == 0 and m["kivi_requests_waiting"] == 0:
            return m
        time.sleep(0.05)
    raise AssertionError(f"slots never returned to free: {m}")


def test_concurrent_greedy_completions_equal_kivi_generate(server):
    url, engine, model, tokenizer = server
    results, lengths = {}, [24, 9, 17, 30, 12]

    def ask(i):
        time.sleep(0.15 * i)  # arrivals at different times, into a batch that is already decoding
        r = client(url).completions.create(model=NAME, prompt=PROMPTS[i], max_tokens=lengths[i], temperature=0)
        results[i] = r

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    for i, r in results.items():
        assert r.choices[0].text == alone(model, tokenizer, PROMPTS[i], lengths[i]), PROMPTS[i]
        assert r.usage.prompt_tokens == len(tokenizer(PROMPTS[i])["input_ids"])
        assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert len(results) == len(PROMPTS)  # 5 requests through 3 slots: two waited (FIFO) and got in
    # One compiled decode graph for every step, whatever joined or left the batch.
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    assert sum(torch._dynamo.utils.counters["recompiles"].values()) == 0
    wait_idle(url)


def test_health_is_ready_only_once_the_compiled_step_has_run(server):
    assert HEALTH[0][0] == 503 and HEALTH[-1] == (200, 1), HEALTH  # not ready while compiling


def test_streams_chat_and_completion(server):
    url, _, model, tokenizer = server
    c = client(url)
    parts = [ch.choices[0].text for ch in c.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=12,
                                                                temperature=0, stream=True)]
    assert "".join(parts) == alone(model, tokenizer, PROMPTS[0], 12) and len(parts) > 2
    chunks = list(c.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "Say hi"}],
                                            max_tokens=8, temperature=0, stream=True))
    streamed = "".join(ch.choices[0].delta.content or "" for ch in chunks)
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    whole = c.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "Say hi"}], max_tokens=8,
                                      temperature=0)
    assert whole.choices[0].message.content == streamed and whole.choices[0].message.role == "assistant"
    raw = httpx.post(f"{url}/v1/completions", json={"model": NAME, "prompt": "Hi", "max_tokens": 3, "stream": True},
                     timeout=60).text
    assert raw.rstrip().endswith("data: [DONE]")
    assert [m.id for m in c.models.list().data] == [NAME]


def test_stop_strings_seed_and_top_p(server):
    url, _, model, tokenizer = server
    c = client(url)
    full = alone(model, tokenizer, PROMPTS[3], 20)
    stop = full[5:8]
    cut = c.completions.create(model=NAME, prompt=PROMPTS[3], max_tokens=20, temperature=0, stop=[stop])
    assert cut.choices[0].finish_reason == "stop" and cut.choices[0].text == full[: full.index(stop)]
    a, b = (c.completions.create(model=NAME, prompt=PROMPTS[4], max_tokens=10, temperature=0.9, top_p=0.9, seed=7)
            for _ in range(2))
    assert a.choices[0].text == b.choices[0].text  # the seed makes sampling reproducible


@pytest.mark.parametrize("body, status, code", [
    (b"{not json", 400, "invalid_json"),
    ({"prompt": "x"}, 400, "invalid_value"),  # missing model
    ({"model": NAME}, 400, "invalid_value"),  # missing prompt
    ({"model": "gpt-5", "prompt": "x"}, 404, "model_not_found"),
    ({"model": NAME, "prompt": "x", "max_tokens": 0}, 400, "invalid_value"),
    ({"model": NAME, "prompt": "x", "max_tokens": -3}, 400, "invalid_value"),
    ({"model": NAME, "prompt": "x", "max_tokens": 1000}, 400, "context_length_exceeded"),
    ({"model": NAME, "prompt": "x", "max_tokens": "5"}, 400, "invalid_value"),
    ({"model": NAME, "prompt": 5}, 400, "invalid_value"),
    ({"model": NAME, "prompt": "x", "temperature": "hot"}, 400, "invalid_value"),
    ({"model": NAME, "prompt": ""}, 400, "invalid_value"),  # names param "prompt"
])
def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(server, body, status, code):
    url = server[0]
    kwargs = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, bytes) else {"json": body}
    r = httpx.post(f"{url}/v1/completions", timeout=30, **kwargs)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["code"] == code and error["message"] and error["type"] == "invalid_request_error"
    ok = httpx.post(f"{url}/v1/completions", json={"model": NAME, "prompt": "Hi", "max_tokens": 2}, timeout=60)
    assert ok.status_code == 200


def test_a_client_that_disconnects_mid_stream_frees_its_slot(server):
    url = server[0]
    with httpx.stream("POST", f"{url}/v1/completions", timeout=60,
                      json={"model": NAME, "prompt": PROMPTS[1], "max_tokens": 60, "stream": True}) as r:
        next(r.iter_lines())  # the first event, then hang up
    m = wait_idle(url, timeout=30)
    assert m["kivi_cache_slots_free"] == SLOTS


def test_bounded_load(server):
    # 12 requests from 4 client threads, capped at 180 s: all complete, the slots come back, and
    # /metrics counts exactly the tokens the clients received.
    url = server[0]
    before = metrics(url)["kivi_generated_tokens_total"]
    done, errors, lock = [], [], threading.Lock()
    deadline = time.time() + 180

    def worker(w):
        c = client(url)
        for i in range(3):
            if time.time() > deadline:
                return
            try:
                r = c.completions.create(model=NAME, prompt=PROMPTS[(w + i) % len(PROMPTS)], max_tokens=4 + 3 * i,
                                         temperature=0)
                with lock:
                    done.append(r.usage.completion_tokens)
            except Exception as e:  # noqa: BLE001 - collected and asserted below
                errors.append(e)

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=200)
    assert not errors and len(done) == 12
    m = wait_idle(url)
    assert m["kivi_generated_tokens_total"] - before == sum(done)
    assert m["kivi_requests_running"] == 0 and m["kivi_cache_bytes"] > 0


@pytest.mark.parametrize("method", ["kivi", "kivi-ott", "fp"])
def test_a_count_0_row_keeps_every_cache_byte_while_others_decode_restart_and_load(method):
    # What the engine relies on (written first by a helper session for its own engine): a row
    # whose count is 0 keeps its state while the other rows decode past key flushes, restart,
    # and receive a staged prefill (load_row). KIVI with a sink pool, and fp.
    import transformers

    from kivi_models.generate import decode_step, prefill

    config = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                      max_position_embeddings=64)
    torch.manual_seed(0)
    model = patch_model(transformers.LlamaForCausalLM(config).eval())
    # kivi-ott: OTT's flush policy with its outlier pool (R=3, G=8: row 0 quantizes groups at 11, 19)
    cfg = {"kivi": KIVIConfig(group_size=8, residual_length=8, sink_tokens=2),
           "kivi-ott": KIVIConfig(group_size=8, residual_length=3, sink_tokens=1, outlier_tokens=2,
                                  outlier_skip_layers=0, flush_policy="ott")}.get(method)
    method = "fp" if method == "fp" else "kivi"
    cache = make_cache(model, method=method, batch_size=2, max_seq_len=40, kivi_config=cfg)
    staging = make_cache(model, method=method, batch_size=1, max_seq_len=40, kivi_config=cfg)
    with torch.inference_mode():
        prefill(model, cache, torch.randint(0, 256, (2, 12)), torch.tensor([12, 12]))
        before = {k: v[1].clone() for k, v in cache.state().items()}  # dim 0 is the row
        tokens, positions = torch.tensor([3, 4]), torch.tensor([12, 12])
        for _ in range(10):  # row 0 decodes past key flushes; row 1 has count 0
            decode_step(model, cache, tokens, positions, torch.tensor([1, 0]))
            positions[0] += 1
        cache.restart_rows(torch.tensor([True, False]))
        prefill(model, staging, torch.randint(0, 256, (1, 9)), torch.tensor([9]))
        cache.load_row(0, staging)
    state = cache.state()
    assert state.keys() == before.keys() and len(state) > 0
    for k, v in state.items():
        row, was = v[1], before[k]
        if method == "fp" and row.dim() == 3:  # FPCache's spare position S takes padding writes, never read
            row, was = row[:, :40], was[:, :40]
        assert torch.equal(row, was), k
    assert cache.lengths().tolist() == [9, 12]
