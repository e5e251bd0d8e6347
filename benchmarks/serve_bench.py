"""`kivi bench serve`: fp vs KIVI cache under the same request stream, at the same cache budget.

The budget decides each cache's slot count by its exact bytes per row (KIVI holds more rows).
Each run drives the serving engine (kivi_models.serve_engine, the same continuous batching
`kivi serve` runs) with a closed loop of clients, each sending its next request when the previous
one finishes, prompts of mixed lengths from a fixed seed, greedy completions of mixed lengths.
Reported: the concurrency held (mean rows in use per decode step), total generated tokens/s, and
time to first token (p50/p99, from submission, so queueing counts).
"""

from __future__ import annotations

import random
import statistics
import threading
import time

from kivi_models.generate import cache_bytes_per_sequence
from kivi_models.serve_engine import Engine, Request


def request_stream(tokenizer, n: int, *, seed: int = 0, prompt_range=(16, 200), new_range=(16, 64)) -> list:
    """n (prompt ids, max_tokens): prompts cut from a fixed text at mixed lengths."""
    from kivi_models.corpus import load_text

    ids = tokenizer(load_text(text_file=None, corpus="pydoc")[:200_000])["input_ids"]
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        length = rng.randint(*prompt_range)
        start = rng.randrange(0, len(ids) - length)
        out.append((ids[start:start + length], rng.randint(*new_range)))
    return out


def run_stream(model, tokenizer, *, method: str, kivi_config, slots: int, max_seq_len: int, requests: list,
               clients: int, compile: bool) -> dict:
    engine = Engine(model, tokenizer, method=method, kivi_config=kivi_config, slots=slots, max_seq_len=max_seq_len,
                    compile=compile)
    # Warm-up (compilation) outside the timing: one short request.
    _complete(engine, requests[0][0], 2)
    engine.generated_tokens = 0
    queue, lock, ttft, tokens = list(requests), threading.Lock(), [], []
    occupancy = []
    stop_sampling = threading.Event()

    def sample_occupancy():
        while not stop_sampling.is_set():
            occupancy.append(engine.stats()["running"])
            time.sleep(0.01)

    def client():
        while True:
            with lock:
                if not queue:
                    return
                prompt, max_tokens = queue.pop(0)
            r = _complete(engine, prompt, max_tokens)
            with lock:
                ttft.append(r.first_token_s - r.submitted_s)
                tokens.append(len(r.tokens))

    sampler = threading.Thread(target=sample_occupancy, daemon=True)
    sampler.start()
    start = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - start
    stop_sampling.set()
    engine.close()
    ttft.sort()
    return dict(method=method, slots=slots, requests=len(requests), clients=clients, seconds=elapsed,
                generated_tokens=sum(tokens), tokens_per_s=sum(tokens) / elapsed,
                requests_per_s=len(requests) / elapsed,
                mean_concurrency=statistics.fmean(occupancy) if occupancy else 0.0,
                ttft_p50_s=ttft[len(ttft) // 2], ttft_p99_s=ttft[min(len(ttft) - 1, int(0.99 * len(ttft)))])


def _complete(engine: Engine, prompt: list[int], max_tokens: int) -> Request:
    done = threading.Event()
    r = Request(prompt_ids=prompt, max_tokens=max_tokens, temperature=0,
                emit=lambda kind, payload: done.set() if kind in ("done", "error") else None)
    engine.submit(r)
    done.wait()
    return r


def bench_serve(model, tokenizer, *, budget_bytes: float, max_seq_len: int, requests: int, clients: int,
                kivi_config, compile: bool, seed: int = 0) -> dict:
    stream = request_stream(tokenizer, requests, seed=seed, new_range=(16, min(64, max_seq_len - 200)))
    rows = []
    for method in ("fp", "kivi"):
        per_row = cache_bytes_per_sequence(model, method=method, tokens=max_seq_len, kivi_config=kivi_config)
        slots = int(budget_bytes // per_row)
        if slots == 0:
            raise ValueError(f"--budget-gib {budget_bytes / 2**30:g} does not hold one {method} row of "
                             f"{max_seq_len} tokens ({per_row / 2**20:.2f} MiB)")
        row = run_stream(model, tokenizer, method=method, kivi_config=kivi_config, slots=slots,
                         max_seq_len=max_seq_len, requests=stream, clients=clients, compile=compile)
        rows.append(dict(row, bytes_per_row=per_row))
    fp, kivi = rows
    return dict(budget_bytes=budget_bytes, max_seq_len=max_seq_len, rows=rows,
                kivi_over_fp_tokens_per_s=kivi["tokens_per_s"] / fp["tokens_per_s"],
                kivi_over_fp_requests_per_s=kivi["requests_per_s"] / fp["requests_per_s"])


def plot_serve(result: dict, path) -> None:
    """Bars per cache: slots, concurrency held, tokens/s and TTFT p50/p99."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    names = [r["method"] for r in rows]
    panels = (("slots at the budget", "slots"), ("concurrency held", "mean_concurrency"),
              ("generated tokens/s", "tokens_per_s"), ("TTFT p50 (s)", "ttft_p50_s"), ("TTFT p99 (s)", "ttft_p99_s"))
    fig, axes = plt.subplots(1, len(panels), figsize=(3 * len(panels), 3.2))
    for ax, (title, key) in zip(axes, panels):
        ax.bar(names, [r[key] for r in rows], color=["#888888", "#2a6fbb"])
        ax.set_title(title, fontsize=9)
    fig.suptitle(f"kivi serve engine, cache budget {result['budget_bytes'] / 2**20:.0f} MiB, "
                 f"{result['rows'][0]['requests']} requests, {result['rows'][0]['clients']} closed-loop clients",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
