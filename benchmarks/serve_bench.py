"""`kivi bench serve`: four caches under the same request stream, at the same cache budget.

The caches: static fp, paged fp (our vLLM-style paged cache, kivi_ops/paged_fp.py), static KIVI and
paged KIVI (kivi_ops/paged.py, where built). The budget decides each one's capacity from its exact
bytes: a static cache gets budget // bytes of a row of max_seq_len tokens rows; a paged cache gets
rows for 1.25x the sequences of the stream's mean length that the budget holds (so that pages, not
rows, bound it) and the pool of pages that the budget holds after those rows' own state.

Each run drives the serving engine (kivi_models.serve_engine, what `kivi serve` runs) with a closed
loop of clients for a fixed time: each client sends its next request of the stream when its last
one finishes; requests still running at the end are cancelled. Prompts and outputs have chat-like
log-normal lengths (traces.py: ShareGPT's means, times `length_scale`), prompts cut from a fixed
text, greedy, EOS ignored (every request generates its drawn length, as vLLM's benchmarks do).
`shared_prefix` puts the same system prompt of that many tokens before every prompt; `prefix_chunk`
runs the paged caches with prefix caching (kivi serve --prefix-caching), so that they share it.

Reported per cache: the sequences held (running requests, sampled every 10 ms: mean and peak),
generated tokens/s, TTFT p50 / p99 (from submission, queueing included; requests that got no
token before the end count as the run's length), preemptions, and pages used (mean and peak).
"""

from __future__ import annotations

import statistics
import threading
import time

from kivi_models.generate import cache_bytes_per_sequence, make_paged_cache, paged_bytes
from kivi_models.serve_engine import Engine, Paging, Request

from .traces import SHAREGPT, chat_lengths

CACHES = ("fp", "fp-paged", "kivi", "kivi-paged")
ROWS_OVER_MEAN = 1.25  # paged rows per sequence of the mean length the budget holds


def request_stream(tokenizer, n: int, *, max_seq_len: int, seed: int = 0, length_scale: float = 1.0,
                   shared_prefix: int = 0) -> list:
    """n (prompt ids, max_tokens): chat-like lengths (traces.py), prompts cut from the pydoc text;
    with shared_prefix, every prompt starts with the same shared_prefix tokens (a system prompt)."""
    import random

    from kivi_models.corpus import load_text

    ids = tokenizer(load_text(text_file=None, corpus="pydoc")[:400_000])["input_ids"]
    system = ids[:shared_prefix]
    room = max_seq_len - shared_prefix
    if room < 2:
        raise ValueError(f"shared_prefix {shared_prefix} leaves no room in --max-seq-len {max_seq_len}")
    rng = random.Random(seed + 1)
    out = []
    for prompt, output in chat_lengths(n, seed=seed, scale=length_scale, max_prompt=room // 2, max_output=room // 2):
        start = rng.randrange(shared_prefix, len(ids) - prompt)
        out.append((system + ids[start:start + prompt], output))
    return out


def plan(model, cache: str, *, budget_bytes: float, max_seq_len: int, kivi_config, stream: list,
         page_size=None, max_rows: int = 256, prefix_chunk=None, shared_prefix: int = 0) -> dict:
    """Rows (and pool pages) of `cache` at the budget, by exact bytes. prefix_chunk: paged caches
    run with prefix caching in chunks of that many tokens (rounded up to a multiple of the page
    size); the rows are then planned for sequences that pay the shared prefix's final pages once."""
    method, paged = cache.split("-")[0], cache.endswith("-paged")
    if not paged:
        per_row = cache_bytes_per_sequence(model, method=method, tokens=max_seq_len, kivi_config=kivi_config)
        slots = int(budget_bytes // per_row)
        if slots == 0:
            raise ValueError(f"--budget-gib {budget_bytes / 2**30:g} does not hold one {cache} row of {max_seq_len} "
                             f"tokens ({per_row / 2**20:.2f} MiB)")
        return dict(cache=cache, method=method, slots=slots, paging=None, bytes=slots * per_row)
    kw = dict(method=method, max_seq_len=max_seq_len, page_size=page_size, kivi_config=kivi_config)
    per_page, fixed1 = paged_bytes(model, batch_size=1, **kw)
    _, fixed2 = paged_bytes(model, batch_size=2, **kw)
    per_row, base = fixed2 - fixed1, 2 * fixed1 - fixed2
    sizer = make_paged_cache(model, batch_size=1, num_pages=1, device="meta", **kw)
    needed = sizer.pages_needed
    chunk = None if prefix_chunk is None else sizer.page_size * -(-prefix_chunk // sizer.page_size)
    shared = 0 if chunk is None else sizer.pages_final(shared_prefix // chunk * chunk)
    mean_seq = (statistics.fmean(needed(len(p) + n) for p, n in stream) - shared) * per_page + per_row
    longest = max(needed(len(p) + n) for p, n in stream)
    affordable = int((budget_bytes - base - longest * per_page) // per_row)  # rows that leave the longest its pages
    rows = max(1, min(max_rows, affordable, int(ROWS_OVER_MEAN * (budget_bytes - base) / mean_seq)))
    pages = int((budget_bytes - base - rows * per_row) // per_page)
    if pages < longest:
        raise ValueError(f"--budget-gib {budget_bytes / 2**30:g} leaves {cache} {pages} pages after {rows} rows; the "
                         f"longest request needs {longest}")
    return dict(cache=cache, method=method, slots=rows, paging=Paging(pages, page_size, chunk),
                bytes=base + rows * per_row + pages * per_page)


def run_stream(model, tokenizer, setup: dict, *, kivi_config, max_seq_len: int, requests: list, clients: int,
               duration: float, compile: bool) -> dict:
    if compile:
        # Each cache compiles its own step; the earlier caches' compiled code would otherwise stay
        # on the same function (dynamo then checks their guards first, and torch 2.13 failed with
        # a KeyError while explaining why they did not match).
        import torch

        torch._dynamo.reset()
    engine = Engine(model, tokenizer, method=setup["method"], kivi_config=kivi_config, slots=setup["slots"],
                    max_seq_len=max_seq_len, compile=compile, paging=setup["paging"], max_waiting=None)
    engine.eos = set()  # every request generates its drawn length
    _complete(engine, requests[0][0][:8], 2)  # warm-up (compilation) outside the timing
    engine.ready.wait()
    engine.generated_tokens = 0
    preempted_before = engine.stats().get("preemptions", 0)
    queue, lock, ttft, started, done = list(requests), threading.Lock(), [], [], []
    samples = []
    stop = threading.Event()
    start = time.perf_counter()

    def sample():
        while not stop.is_set():
            s = engine.stats()
            samples.append((s["running"], s.get("pages_used", 0)))
            time.sleep(0.01)

    def client():
        while not stop.is_set():
            with lock:
                if not queue:
                    return
                prompt, max_tokens = queue.pop(0)
            event = threading.Event()
            r = Request(prompt_ids=prompt, max_tokens=max_tokens, temperature=0,
                        emit=lambda kind, payload: event.set() if kind in ("done", "error") else None)
            with lock:
                started.append(r)
            engine.submit(r)
            while not event.wait(0.05):
                if stop.is_set():
                    engine.cancel(r)
                    return
            with lock:
                done.append(r)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    threads = [threading.Thread(target=client, daemon=True) for _ in range(clients)]
    for t in threads:
        t.start()
    stopper = threading.Timer(duration, stop.set)
    stopper.start()
    for t in threads:
        t.join()
    stop.set()
    stopper.cancel()
    elapsed = time.perf_counter() - start
    tokens = engine.generated_tokens  # tokens generated inside the run, finished requests or not
    stats = engine.stats()
    engine.close()
    ttft = sorted((r.first_token_s if r.first_token_s is not None else start + elapsed) - r.submitted_s for r in started)
    held = [s[0] for s in samples] or [0]
    pages = [s[1] for s in samples] or [0]
    row = dict(cache=setup["cache"], method=setup["method"], paged=setup["paging"] is not None, rows=setup["slots"],
               cache_bytes=setup["bytes"], requests_started=len(started), requests_done=len(done), seconds=elapsed,
               generated_tokens=tokens, tokens_per_s=tokens / elapsed, mean_held=statistics.fmean(held),
               peak_held=max(held), ttft_p50_s=ttft[len(ttft) // 2] if ttft else None,
               ttft_p99_s=ttft[min(len(ttft) - 1, int(0.99 * len(ttft)))] if ttft else None,
               preemptions=stats.get("preemptions", 0) - preempted_before)
    if setup["paging"] is not None:
        row.update(pages=setup["paging"].num_pages, page_size=engine.cache.page_size,
                   mean_pages_used=statistics.fmean(pages), peak_pages_used=max(pages))
    if "prefix_hits" in stats:
        row.update(prefix_chunk=setup["paging"].prefix_chunk, prefix_hits=stats["prefix_hits"],
                   prefix_hit_tokens=stats["prefix_hit_tokens"], pages_cached=stats["pages_cached"])
    return row


def _complete(engine: Engine, prompt: list[int], max_tokens: int) -> Request:
    done = threading.Event()
    r = Request(prompt_ids=prompt, max_tokens=max_tokens, temperature=0,
                emit=lambda kind, payload: done.set() if kind in ("done", "error") else None)
    engine.submit(r)
    done.wait()
    return r


def bench_serve(model, tokenizer, *, budget_bytes: float, max_seq_len: int, requests: int, clients=None,
                kivi_config, compile: bool, seed: int = 0, caches=CACHES, duration: float = 60.0,
                length_scale: float = 1.0, shared_prefix: int = 0, page_size=None, max_rows: int = 256,
                prefix_chunk=None) -> dict:
    """Each cache in `caches` serves the same stream for `duration` seconds at the same budget.
    clients: concurrent closed-loop clients (default: the most rows any cache gets, so that every
    cache can fill up). A cache that cannot be built here (paged KIVI without kivi_ops.paged) is
    reported as skipped, with the reason."""
    stream = request_stream(tokenizer, requests, max_seq_len=max_seq_len, seed=seed, length_scale=length_scale,
                            shared_prefix=shared_prefix)
    setups, skipped = [], {}
    for cache in caches:
        try:
            setups.append(plan(model, cache, budget_bytes=budget_bytes, max_seq_len=max_seq_len,
                               kivi_config=kivi_config, stream=stream,
                               page_size=page_size if cache == "kivi-paged" else None, max_rows=max_rows,
                               prefix_chunk=prefix_chunk, shared_prefix=shared_prefix))
        except ValueError as e:
            if cache != "kivi-paged" or "kivi_ops.paged" not in str(e):
                raise
            skipped[cache] = str(e)
    clients = clients or max(s["slots"] for s in setups)
    rows = [run_stream(model, tokenizer, s, kivi_config=kivi_config, max_seq_len=max_seq_len, requests=stream,
                       clients=clients, duration=duration, compile=compile) for s in setups]
    by = {r["cache"]: r for r in rows}
    ratios = {}
    for a, b in (("kivi-paged", "fp-paged"), ("kivi-paged", "kivi"), ("fp-paged", "fp"), ("kivi", "fp")):
        if a in by and b in by:
            ratios[f"{a}_over_{b}"] = dict(mean_held=by[a]["mean_held"] / max(by[b]["mean_held"], 1e-9),
                                           tokens_per_s=by[a]["tokens_per_s"] / by[b]["tokens_per_s"])
    prompt_mean = statistics.fmean(len(p) for p, _ in stream)
    output_mean = statistics.fmean(n for _, n in stream)
    return dict(budget_bytes=budget_bytes, max_seq_len=max_seq_len, requests=requests, clients=clients,
                duration_s=duration, trace=SHAREGPT, length_scale=length_scale, shared_prefix=shared_prefix,
                prefix_chunk=prefix_chunk,
                drawn_prompt_mean=prompt_mean, drawn_output_mean=output_mean, kivi_config=repr(kivi_config),
                rows=rows, skipped=skipped, ratios=ratios)


def plot_serve(result: dict, path) -> None:
    """Bars per cache: sequences held (mean), tokens/s, TTFT p50/p99, preemptions."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    names = [r["cache"] for r in rows]
    panels = (("sequences held (mean)", "mean_held"), ("peak held", "peak_held"), ("generated tokens/s", "tokens_per_s"),
              ("TTFT p50 (s)", "ttft_p50_s"), ("TTFT p99 (s)", "ttft_p99_s"), ("preemptions", "preemptions"))
    colors = {"fp": "#888888", "fp-paged": "#bbbbbb", "kivi": "#2a6fbb", "kivi-paged": "#7fb3e6"}
    fig, axes = plt.subplots(1, len(panels), figsize=(3 * len(panels), 3.4))
    for ax, (title, key) in zip(axes, panels):
        ax.bar(names, [r[key] or 0 for r in rows], color=[colors.get(n, "#444444") for n in names])
        ax.set_title(title, fontsize=9)
        ax.tick_params(axis="x", labelsize=7, rotation=30)
    prefix = f", shared {result['shared_prefix']}-token prompt" if result["shared_prefix"] else ""
    fig.suptitle(f"kivi serve engine, cache budget {result['budget_bytes'] / 2**20:.0f} MiB, "
                 f"{result['clients']} closed-loop clients, {result['duration_s']:g} s each, lengths "
                 f"{result['length_scale']:g} x ShareGPT{prefix}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def serve_markdown(result: dict) -> str:
    """The run as a Markdown table, with the ratios the issue's targets name."""
    prefix = f", every prompt after the same {result['shared_prefix']}-token system prompt" if result["shared_prefix"] else ""
    lines = [f"Cache budget {result['budget_bytes'] / 2**30:g} GiB, {result['max_seq_len']} tokens per static row, "
             f"{result['clients']} closed-loop clients, {result['duration_s']:g} s per cache; lengths log-normal with "
             f"{result['length_scale']:g} x ShareGPT's means (drawn: prompt {result['drawn_prompt_mean']:.0f}, output "
             f"{result['drawn_output_mean']:.0f} tokens){prefix}; {result['kivi_config']}.", "",
             "| cache | rows | pages (size) | held mean | held peak | tokens/s | TTFT p50 s | TTFT p99 s | preemptions "
             "| pages used mean / peak |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in result["rows"]:
        pages = f"{r['pages']} ({r['page_size']})" if r["paged"] else ""
        used = f"{r['mean_pages_used']:.0f} / {r['peak_pages_used']}" if r["paged"] else ""
        lines.append(f"| {r['cache']} | {r['rows']} | {pages} | {r['mean_held']:.1f} | {r['peak_held']} | "
                     f"{r['tokens_per_s']:.1f} | {r['ttft_p50_s']:.2f} | {r['ttft_p99_s']:.2f} | {r['preemptions']} | "
                     f"{used} |")
    for name, ratio in result["ratios"].items():
        lines.append(f"\n{name.replace('_over_', ' / ')}: {ratio['mean_held']:.2f}x sequences held, "
                     f"{ratio['tokens_per_s']:.2f}x tokens/s")
    for cache, why in result["skipped"].items():
        lines.append(f"\n{cache}: not run ({why})")
    return "\n".join(lines) + "\n"
