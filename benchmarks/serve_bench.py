"""`kivi bench serve`: four caches under the same request stream, at the same cache budget.

The caches: static fp, paged fp (our vLLM-style paged cache, kivi_ops/cache/paged_fp.py), static KIVI and
paged KIVI (kivi_ops/cache/paged.py, where built). The budget decides each one's capacity from its exact
bytes: a static cache gets budget // bytes of a row of max_seq_len tokens rows; a paged cache gets
as many rows as sequences the budget holds at the pages a sequence of the stream holds in flight
(plan()), and the pool of pages that the budget holds after those rows' own state.

Each run drives the serving engine (kivi_serve.engine, what `kivi serve` runs) with a closed
loop of clients for a fixed time: each client sends its next request of the stream when its last
one finishes; requests still running at the end are cancelled. Prompts and outputs have chat-like
log-normal lengths (traces.py: ShareGPT's means, times `length_scale`), prompts cut from a fixed
text, greedy, EOS ignored (every request generates its drawn length, as vLLM's benchmarks do).
`shared_prefix` puts the same system prompt of that many tokens before every prompt; `prefix_chunk`
runs the paged caches with prefix caching (kivi serve --prefix-caching), so that they share it.

Reported per cache, over three windows: the whole run (the startup fill included, what earlier
versions reported as tokens/s), the run after the fill (from the first decode step with at least
`steady_fill` (0.9) of the largest batch any step decoded: a server with 126 rows prefills 126
prompts one at a time before that step), and the steady state, which the serving numbers are read
from: it starts once the server has also completed `warmup_turnover` (1.0) x that batch requests,
so that the initial fill's sequences, which all started together with short prompts, have been
replaced once on average, and runs to the end (steady_start()). A run too short for that has no
steady window (reported, with the completions it had). In each window, as vLLM's benchmark_serving
reports them: requests completed per second, output tokens/s (tokens generated inside the window,
from the engine's counter sampled every 10 ms), total tokens/s (output + the prompt tokens of the
prompts prefilled inside the window), TTFT (submission to first token, queueing included, over
requests whose first token came inside the window), TPOT ((completion - first token) / (output
tokens - 1), over requests whose first token and completion both fall inside it) and ITL (the gaps
between a request's streamed text events inside it), each p50 / p99 (percentile(): linear
interpolation, numpy's default). Also per window: the sequences held (rows in use, sampled every
10 ms: mean and peak), preemptions, pages used, the engine's time in prefills and in decode steps
(its executor's prefill and decode timed from the bench), and the share of a core the engine thread got
(its CPU clock over the wall clock: on a shared machine the caches, run one after the other, get
different shares, and output tokens per engine CPU second compares them with less of that noise).
The steady window's output tokens/s is also given for its two halves: where they differ much, the
run was too short or the machine's load changed. Legacy whole-run keys (tokens_per_s, ttft_p50_s,
...) keep their earlier meaning; TTFT there counts a request that got no token before the end as
the run's length.
"""

from __future__ import annotations

import math
import statistics
import threading
import time

from kivi_models.generate import cache_bytes_per_sequence, make_paged_cache, paged_bytes
from kivi_serve.config import ServeConfig
from kivi_serve.engine import Engine
from kivi_serve.paged_options import PagedServing
from kivi_serve.request import Request

from .perf import kivi_bits
from .traces import SHAREGPT, chat_lengths

CACHES = ("fp", "fp-paged", "kivi", "kivi-paged")


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
    # The rows are as many sequences as the budget holds at the pages a sequence holds in flight:
    # the mean over every decode step of every request (a request holds its row for as many steps
    # as it has output tokens, so long ones weigh more). More rows would take pages (a KIVI row's
    # fixed state, its fp window, is as large as several pages) and preempt; fewer would leave pages
    # idle. Idle rows cost a decode step nothing (decode buckets), only their state's bytes.
    steps = sum(n for _, n in stream)
    in_flight = sum(needed(len(p) + t + 1) for p, n in stream for t in range(n)) / steps - shared
    longest = max(needed(len(p) + n) for p, n in stream)
    affordable = int((budget_bytes - base - longest * per_page) // per_row)  # rows that leave the longest its pages
    rows = max(1, min(max_rows, affordable, round((budget_bytes - base) / (per_row + in_flight * per_page))))
    pages = int((budget_bytes - base - rows * per_row) // per_page)
    if pages < longest:
        raise ValueError(f"--budget-gib {budget_bytes / 2**30:g} leaves {cache} {pages} pages after {rows} rows; the "
                         f"longest request needs {longest}")
    return dict(cache=cache, method=method, slots=rows, paging=PagedServing(pages, page_size, chunk),
                bytes=base + rows * per_row + pages * per_page)


STEADY_FILL = 0.9  # the fill is done at the first decode step of at least this share of the largest batch
WARMUP_TURNOVER = 1.0  # and the steady window starts after this many completions per row of that batch


def percentile(values, q: float):
    """The q-th percentile (0-100) of values, linear between the closest ranks (numpy's default);
    None for no values."""
    xs = sorted(values)
    if not xs:
        return None
    if not 0 <= q <= 100:
        raise ValueError(f"q must be in [0, 100], got {q}")
    at = (len(xs) - 1) * q / 100
    lo = int(at)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (at - lo)


def fill_done(phases: list, samples: list, fill: float = STEADY_FILL):
    """(time, batch): when the initial fill is done, the start of the first decode step that ran at
    least ceil(fill x the largest batch any step of the run decoded) rows, and that largest batch.
    phases: (kind, start, end, n) as window_metrics takes them. Without decode phases, from the
    samples (t, held, ...): the first at ceil(fill x the peak held) (held counts rows admitted but
    not yet prefilled, so this comes earlier). (None, 0) when nothing ran."""
    import math

    if not 0 < fill <= 1:
        raise ValueError(f"fill must be in (0, 1], got {fill}")
    steps = [(a, n) for kind, a, _, n in phases if kind == "decode"] or [(s[0], s[1]) for s in samples]
    peak = max((n for _, n in steps), default=0)
    if peak == 0:
        return None, 0
    need = math.ceil(fill * peak - 1e-9)
    return next(t for t, n in steps if n >= need), peak


def steady_start(phases: list, samples: list, done_s: list, *, fill: float = STEADY_FILL,
                 turnover: float = WARMUP_TURNOVER):
    """The start of the steady window, or None when the run has none: the later of the fill being
    done (fill_done) and the completion of the first ceil(turnover x that largest batch) requests
    (done_s: completion times), so that the sequences of the initial fill, which all started
    together with short prompts, have been replaced once on average."""
    import math

    if turnover < 0:
        raise ValueError(f"turnover must be >= 0, got {turnover}")
    t_fill, batch = fill_done(phases, samples, fill)
    if t_fill is None:
        return None
    need = math.ceil(turnover * batch - 1e-9)
    if need == 0:
        return t_fill
    done = sorted(done_s)
    return max(t_fill, done[need - 1]) if len(done) >= need else None


def _overlap(a: float, b: float, t0: float, t1: float) -> float:
    return max(0.0, min(b, t1) - max(a, t0))


def window_metrics(requests: list, samples: list, phases: list, t0: float, t1: float) -> dict:
    """Serving metrics over [t0, t1], from what a run recorded (times in seconds, one clock):
    requests: dicts with submitted_s, first_token_s (None: no token yet), done_s (None: not
    completed), prompt_tokens, output_tokens (generated by the end), chunk_s (the times of its
    streamed text events); samples: (t, held, pages used, generated tokens so far, preemptions so
    far[, the engine thread's CPU seconds so far]), in time order, one at or before t0 and one at
    t1; phases: (kind "prefill" or "decode", start, end, prompts prefilled or rows decoded).
    With the CPU clock: engine_cpu_share, the share of one core the engine thread got in the
    window (below 1: other work had the CPU), and output tokens per engine CPU second, which
    depends much less on that than tokens/s does."""
    seconds = t1 - t0
    if not seconds > 0:
        raise ValueError(f"empty window [{t0}, {t1}]")
    inside = lambda t: t is not None and t0 <= t <= t1  # noqa: E731

    def at(t):  # the last sample at or before t
        before = [s for s in samples if s[0] <= t]
        return before[-1] if before else samples[0]

    first, last = at(t0), at(t1)
    output = last[3] - first[3]
    done = [r for r in requests if inside(r["done_s"])]
    prefilled = [r for r in requests if inside(r["first_token_s"])]
    prompt = sum(r["prompt_tokens"] for r in prefilled)
    ttft = [r["first_token_s"] - r["submitted_s"] for r in prefilled]
    tpot = [(r["done_s"] - r["first_token_s"]) / (r["output_tokens"] - 1) for r in done
            if r["output_tokens"] > 1 and r["first_token_s"] >= t0]
    itl = [b - a for r in requests for a, b in zip(r["chunk_s"], r["chunk_s"][1:]) if t0 <= a and b <= t1]
    held = [s[1] for s in samples if t0 <= s[0] <= t1] or [first[1]]
    pages = [s[2] for s in samples if t0 <= s[0] <= t1] or [first[2]]
    out = dict(seconds=seconds, requests_done=len(done), requests_per_s=len(done) / seconds,
               output_tokens=output, output_tokens_per_s=output / seconds, prompt_tokens=prompt,
               total_tokens_per_s=(output + prompt) / seconds,
               ttft_p50_s=percentile(ttft, 50), ttft_p99_s=percentile(ttft, 99),
               tpot_p50_s=percentile(tpot, 50), tpot_p99_s=percentile(tpot, 99),
               itl_p50_s=percentile(itl, 50), itl_p99_s=percentile(itl, 99),
               mean_held=statistics.fmean(held), peak_held=max(held), mean_pages_used=statistics.fmean(pages),
               peak_pages_used=max(pages), preemptions=last[4] - first[4])
    for kind in ("prefill", "decode"):
        mine = [(a, b, n) for k, a, b, n in phases if k == kind and _overlap(a, b, t0, t1) > 0]
        out[f"{kind}_s"] = sum(_overlap(a, b, t0, t1) for a, b, _ in mine)
        out[f"{kind}_calls"] = len(mine)
    if len(first) > 5 and len(last) > 5:
        cpu = last[5] - first[5]
        out.update(engine_cpu_s=cpu, engine_cpu_share=cpu / seconds,
                   output_tokens_per_engine_cpu_s=output / cpu if cpu > 0 else None)
    out["prefill_s_per_prompt"] = out["prefill_s"] / len(prefilled) if prefilled else None
    out["decode_s_per_step"] = out["decode_s"] / out["decode_calls"] if out["decode_calls"] else None
    return out


def _time_phases(engine: Engine, phases: list) -> None:
    """Record (kind, start, end, n) for each of the engine's prefills (n: 1 prompt) and decode steps
    (n: rows decoded), wrapping its runner's methods on this instance."""
    import functools

    def timed(kind, fn, count):
        @functools.wraps(fn)
        def run(*args):
            n = count(*args)
            start = time.perf_counter()
            try:
                return fn(*args)
            finally:
                phases.append((kind, start, time.perf_counter(), n))
        return run

    runner = engine.runner  # what a round's plan calls (serve/runner.py, Runner.execute)
    runner.prefill = timed("prefill", runner.prefill, lambda *args: 1)
    runner.prefill_chunked = timed("prefill", runner.prefill_chunked, lambda *args: 1)
    runner.decode = timed("decode", runner.decode, lambda tokens: sum(t >= 0 for t in tokens))


def run_stream(model, tokenizer, setup: dict, *, kivi_config, max_seq_len: int, requests: list, clients: int,
               duration: float, compile: bool, steady_fill: float = STEADY_FILL,
               warmup_turnover: float = WARMUP_TURNOVER) -> dict:
    if compile:
        # Each cache compiles its own step; the earlier caches' compiled code would otherwise stay
        # on the same function (dynamo then checks their guards first, and torch 2.13 failed with
        # a KeyError while explaining why they did not match).
        import torch

        torch._dynamo.reset()
    config = ServeConfig(method=setup["method"], kivi_config=kivi_config, slots=setup["slots"], max_seq_len=max_seq_len,
                         compile=compile, paging=setup["paging"], max_waiting=None,
                         eos_token_ids=set())  # every request generates its drawn length
    engine = Engine(model, tokenizer, config)
    phases = []
    _time_phases(engine, phases)
    decoded_rows = []  # (time, rows) of each decode step (paged: the rows of its bucket)
    real_decode = engine.runner.decode
    engine.runner.decode = lambda tokens: decoded_rows.append((time.perf_counter(), len(tokens))) or real_decode(tokens)
    _complete(engine, requests[0][0][:8], 2)  # warm-up (compilation) outside the timing
    engine.ready.wait()
    engine.executor.generated_tokens = 0  # the warm-up's tokens are not the stream's
    preempted_before = engine.stats().get("preemptions", 0)
    queue, lock, records, started, done = list(requests), threading.Lock(), [], [], []
    samples = []  # (t, held, pages used, generated tokens, preemptions, the engine thread's CPU seconds)
    stop = threading.Event()
    clock = time.pthread_getcpuclockid(engine.thread.ident) if hasattr(time, "pthread_getcpuclockid") else None
    start = time.perf_counter()

    def snapshot():
        s = engine.stats()
        cpu = time.clock_gettime(clock) if clock is not None else float("nan")
        return (time.perf_counter(), s["running"], s.get("pages_used", 0), s["generated_tokens"],
                s.get("preemptions", 0) - preempted_before, cpu)

    def sample():
        while not stop.is_set():
            samples.append(snapshot())
            time.sleep(0.01)

    def client():
        while not stop.is_set():
            with lock:
                if not queue:
                    return
                prompt, max_tokens = queue.pop(0)
            event = threading.Event()
            rec = dict(prompt_tokens=len(prompt), chunk_s=[], done_s=None)

            def emit(kind, payload, rec=rec, event=event):
                now = time.perf_counter()
                if kind == "text":
                    rec["chunk_s"].append(now)
                elif kind == "done":
                    rec["done_s"] = now
                if kind in ("done", "error"):
                    event.set()

            r = Request(prompt_ids=prompt, max_tokens=max_tokens, temperature=0, emit=emit)
            rec["request"] = r
            with lock:
                started.append(r)
                records.append(rec)
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
    sampler.join()
    samples.append(snapshot())
    end = samples[-1][0]  # the run ends at its last sample, so every window's counts come from samples inside it
    elapsed = end - start
    run_rows = [n for t, n in decoded_rows if start <= t < end]  # the decode steps inside the run
    tokens = samples[-1][3]  # tokens generated inside the run (at its end), finished requests or not
    stats = engine.stats()
    engine.close()
    ttft = sorted((r.first_token_s if r.first_token_s is not None else start + elapsed) - r.submitted_s for r in started)
    held = [s[1] for s in samples] or [0]
    pages = [s[2] for s in samples] or [0]
    reqs = [dict(submitted_s=rec["request"].submitted_s, first_token_s=rec["request"].first_token_s,
                 done_s=rec["done_s"], prompt_tokens=rec["prompt_tokens"], output_tokens=len(rec["request"].tokens),
                 chunk_s=rec["chunk_s"]) for rec in records]
    samples.insert(0, (start, 0, 0, 0, 0, samples[0][5]))
    row = dict(cache=setup["cache"], method=setup["method"], paged=setup["paging"] is not None, rows=setup["slots"],
               cache_bytes=setup["bytes"], requests_started=len(started), requests_done=len(done), seconds=elapsed,
               generated_tokens=tokens, tokens_per_s=tokens / elapsed, mean_held=statistics.fmean(held),
               peak_held=max(held), ttft_p50_s=ttft[len(ttft) // 2] if ttft else None,
               ttft_p99_s=ttft[min(len(ttft) - 1, int(0.99 * len(ttft)))] if ttft else None,
               preemptions=stats.get("preemptions", 0) - preempted_before, decode_buckets=list(engine.placement.buckets),
               mean_decode_rows=statistics.fmean(run_rows) if run_rows else None)
    if setup["paging"] is not None:
        row.update(pages=setup["paging"].num_pages, page_size=engine.cache.page_size,
                   mean_pages_used=statistics.fmean(pages), peak_pages_used=max(pages))
    if "prefix_hits" in stats:
        row.update(prefix_chunk=setup["paging"].prefix_chunk, prefix_hits=stats["prefix_hits"],
                   prefix_hit_tokens=stats["prefix_hit_tokens"], pages_cached=stats["pages_cached"])
    run_phases = [ph for ph in phases if start <= ph[1] < end]  # the engine goes on stepping until closed
    row["whole"] = window_metrics(reqs, samples, run_phases, start, end)
    # completions inside the run only: a request the engine finished after `end` (it steps until
    # closed) must not open a steady window that the run's counts (window_metrics) do not see
    done_s = [r["done_s"] for r in reqs if r["done_s"] is not None and r["done_s"] <= end]
    t_fill, batch = fill_done(run_phases, samples, steady_fill)
    t0 = steady_start(run_phases, samples, done_s, fill=steady_fill, turnover=warmup_turnover)
    row.update(steady_fill=steady_fill, warmup_turnover=warmup_turnover, largest_batch=batch,
               fill_done_s=None if t_fill is None else t_fill - start,
               warmup_completions=math.ceil(warmup_turnover * batch - 1e-9),
               after_fill=window_metrics(reqs, samples, run_phases, t_fill, end) if t_fill is not None else None)
    row["steady_from_s"] = None if t0 is None or t0 >= end else t0 - start
    if row["steady_from_s"] is not None:
        row["steady"] = window_metrics(reqs, samples, run_phases, t0, end)
        mid = (t0 + end) / 2
        row["steady_halves_output_tokens_per_s"] = [window_metrics(reqs, samples, run_phases, a, b)["output_tokens_per_s"]
                                                    for a, b in ((t0, mid), (mid, end))]
    else:
        row["steady"] = None
    # What the run recorded (times from its start), so that other windows can be computed later.
    rel = lambda t: None if t is None else round(t - start, 4)  # noqa: E731
    row["trace"] = dict(
        requests=[[rel(r["submitted_s"]), rel(r["first_token_s"]), rel(r["done_s"]), r["prompt_tokens"],
                   r["output_tokens"]] for r in reqs],
        samples=[[rel(s[0]), *s[1:]] for s in samples[::25]] + [[rel(samples[-1][0]), *samples[-1][1:]]])
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
                prefix_chunk=None, steady_fill: float = STEADY_FILL, warmup_turnover: float = WARMUP_TURNOVER) -> dict:
    """Each cache in `caches` serves the same stream for `duration` seconds at the same budget.
    clients: concurrent closed-loop clients (default: the most rows any cache gets, so that every
    cache can fill up). A cache that cannot be built here (paged KIVI without kivi_ops.cache.paged) is
    reported as skipped, with the reason. steady_fill, warmup_turnover: where the steady window
    starts (steady_start)."""
    if not 0 < steady_fill <= 1:
        raise ValueError(f"steady_fill must be in (0, 1], got {steady_fill}")
    if not warmup_turnover >= 0:
        raise ValueError(f"warmup_turnover must be >= 0, got {warmup_turnover}")
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
            if cache != "kivi-paged" or "kivi_ops.cache.paged" not in str(e):
                raise
            skipped[cache] = str(e)
    clients = clients or max(s["slots"] for s in setups)
    rows = [run_stream(model, tokenizer, s, kivi_config=kivi_config, max_seq_len=max_seq_len, requests=stream,
                       clients=clients, duration=duration, compile=compile, steady_fill=steady_fill,
                       warmup_turnover=warmup_turnover) for s in setups]
    by = {r["cache"]: r for r in rows}
    ratios = {}
    for a, b in (("kivi-paged", "fp-paged"), ("kivi-paged", "kivi"), ("fp-paged", "fp"), ("kivi", "fp")):
        if a in by and b in by:
            # requests/s over the whole run too: a short run (a GPU stage's minute, compiles first)
            # may have no steady window, and the issue's target is read in requests/s
            ratios[f"{a}_over_{b}"] = dict(mean_held=by[a]["mean_held"] / max(by[b]["mean_held"], 1e-9),
                                           tokens_per_s=by[a]["tokens_per_s"] / by[b]["tokens_per_s"],
                                           requests_per_s=by[a]["whole"]["requests_per_s"]
                                           / max(by[b]["whole"]["requests_per_s"], 1e-9))
            if by[a]["steady"] and by[b]["steady"]:
                sa, sb = by[a]["steady"], by[b]["steady"]
                ratios[f"{a}_over_{b}"].update(
                    steady_mean_held=sa["mean_held"] / max(sb["mean_held"], 1e-9),
                    steady_output_tokens_per_s=sa["output_tokens_per_s"] / max(sb["output_tokens_per_s"], 1e-9),
                    steady_requests_per_s=sa["requests_per_s"] / max(sb["requests_per_s"], 1e-9))
                if sa.get("output_tokens_per_engine_cpu_s") and sb.get("output_tokens_per_engine_cpu_s"):
                    ratios[f"{a}_over_{b}"]["steady_output_tokens_per_engine_cpu_s"] = (
                        sa["output_tokens_per_engine_cpu_s"] / sb["output_tokens_per_engine_cpu_s"])
    prompt_mean = statistics.fmean(len(p) for p, _ in stream)
    output_mean = statistics.fmean(n for _, n in stream)
    return dict(budget_bytes=budget_bytes, max_seq_len=max_seq_len, requests=requests, clients=clients,
                duration_s=duration, steady_fill=steady_fill, warmup_turnover=warmup_turnover, trace=SHAREGPT,
                length_scale=length_scale, shared_prefix=shared_prefix, prefix_chunk=prefix_chunk,
                drawn_prompt_mean=prompt_mean, drawn_output_mean=output_mean, kivi_config=repr(kivi_config),
                **(kivi_bits(model, kivi_config, max_seq_len) if any(c.startswith("kivi") for c in caches) else {}),
                rows=rows, skipped=skipped, ratios=ratios)


def plot_serve(result: dict, path) -> None:
    """Bars per cache: sequences held (mean), tokens/s (steady and whole run), TTFT and TPOT p50,
    preemptions; the steady window's figures where the run has one."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    names = [r["cache"] for r in rows]
    steady = lambda r, key: (r.get("steady") or {}).get(key) or 0  # noqa: E731
    panels = (("sequences held, steady (mean)", lambda r: steady(r, "mean_held")),
              ("output tokens/s, steady", lambda r: steady(r, "output_tokens_per_s")),
              ("output tokens/s, whole run", lambda r: r["tokens_per_s"]),
              ("requests/s, steady", lambda r: steady(r, "requests_per_s")),
              ("TTFT p50 (s), steady", lambda r: steady(r, "ttft_p50_s")),
              ("TPOT p50 (s), steady", lambda r: steady(r, "tpot_p50_s")),
              ("prefill share of time, steady", lambda r: steady(r, "prefill_s") / max(steady(r, "seconds"), 1e-9)),
              ("preemptions", lambda r: r["preemptions"]))
    colors = {"fp": "#888888", "fp-paged": "#bbbbbb", "kivi": "#2a6fbb", "kivi-paged": "#7fb3e6"}
    fig, axes = plt.subplots(2, 4, figsize=(12, 6.4))
    for ax, (title, value) in zip(axes.flat, panels):
        ax.bar(names, [value(r) or 0 for r in rows], color=[colors.get(n, "#444444") for n in names])
        ax.set_title(title, fontsize=9)
        ax.tick_params(axis="x", labelsize=7, rotation=30)
    prefix = f", shared {result['shared_prefix']}-token prompt" if result["shared_prefix"] else ""
    fig.suptitle(f"kivi serve engine, cache budget {result['budget_bytes'] / 2**20:.0f} MiB, "
                 f"{result['clients']} closed-loop clients, {result['duration_s']:g} s each, lengths "
                 f"{result['length_scale']:g} x ShareGPT{prefix}; steady: after the fill and "
                 f"{result.get('warmup_turnover', 0):g} x its batch completions", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _f(x, fmt=".2f"):
    return "" if x is None else format(x, fmt)


def serve_markdown(result: dict) -> str:
    """The run as Markdown tables (steady state, then the whole run), with the ratios the issue's
    targets name."""
    prefix = f", every prompt after the same {result['shared_prefix']}-token system prompt" if result["shared_prefix"] else ""
    fill = result.get("steady_fill")
    lines = [f"Cache budget {result['budget_bytes'] / 2**30:g} GiB, {result['max_seq_len']} tokens per static row, "
             f"{result['clients']} closed-loop clients, {result['duration_s']:g} s per cache; lengths log-normal with "
             f"{result['length_scale']:g} x ShareGPT's means (drawn: prompt {result['drawn_prompt_mean']:.0f}, output "
             f"{result['drawn_output_mean']:.0f} tokens){prefix}; {result['kivi_config']}.", ""]
    if fill is not None:
        lines += [f"Steady state: from the later of the fill being done (the first decode step of at least {fill:g} x "
                  f"the largest batch) and {result.get('warmup_turnover', 0):g} x that batch completions, to the end "
                  "of the run.", "",
                  "| cache | rows | steady from s | held mean (peak) | requests/s | output tok/s (halves) | total tok/s "
                  "| TTFT p50 / p99 s | TPOT p50 / p99 s | ITL p50 / p99 s | prefill s / decode s (per prompt, per step) "
                  "| engine CPU share (output tok per CPU s) | preemptions | pages used mean / peak |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        for r in result["rows"]:
            st = r.get("steady")
            if not st:
                got = r["whole"]["requests_done"]
                lines.append(f"| {r['cache']} | {r['rows']} | none: {got} of {r.get('warmup_completions')} warm-up "
                             f"completions | | | | | | | | | | | |")
                continue
            halves = " / ".join(f"{h:.1f}" for h in r["steady_halves_output_tokens_per_s"])
            used = f"{st['mean_pages_used']:.0f} / {st['peak_pages_used']}" if r["paged"] else ""
            lines.append(
                f"| {r['cache']} | {r['rows']} | {r['steady_from_s']:.1f} | {st['mean_held']:.1f} ({st['peak_held']}) | "
                f"{st['requests_per_s']:.3f} | {st['output_tokens_per_s']:.1f} ({halves}) | {st['total_tokens_per_s']:.1f} | "
                f"{_f(st['ttft_p50_s'])} / {_f(st['ttft_p99_s'])} | {_f(st['tpot_p50_s'], '.3f')} / "
                f"{_f(st['tpot_p99_s'], '.3f')} | {_f(st['itl_p50_s'], '.3f')} / {_f(st['itl_p99_s'], '.3f')} | "
                f"{st['prefill_s']:.1f} / {st['decode_s']:.1f} ({_f(st['prefill_s_per_prompt'], '.3f')}, "
                f"{_f(st['decode_s_per_step'], '.3f')}) | {_f(st.get('engine_cpu_share'))} "
                f"({_f(st.get('output_tokens_per_engine_cpu_s'), '.1f')}) | {st['preemptions']} | {used} |")
        lines += ["", "After the fill (from its first decode step of the largest batch to the end; the initial "
                  "sequences' turnover included):", "",
                  "| cache | from s | held mean (peak) | requests/s | output tok/s | total tok/s | prefill s / decode s "
                  "| engine CPU share (output tok per CPU s) | preemptions |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        for r in result["rows"]:
            af = r.get("after_fill")
            if af:
                lines.append(f"| {r['cache']} | {r['fill_done_s']:.1f} | {af['mean_held']:.1f} ({af['peak_held']}) | "
                             f"{af['requests_per_s']:.3f} | {af['output_tokens_per_s']:.1f} | "
                             f"{af['total_tokens_per_s']:.1f} | {af['prefill_s']:.1f} / {af['decode_s']:.1f} | "
                             f"{_f(af.get('engine_cpu_share'))} ({_f(af.get('output_tokens_per_engine_cpu_s'), '.1f')}) "
                             f"| {af['preemptions']} |")
        lines += ["", "Whole run (the fill included):", ""]
    lines += ["| cache | rows | pages (size) | held mean | held peak | tokens/s | TTFT p50 s | TTFT p99 s | preemptions "
              "| pages used mean / peak |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in result["rows"]:
        pages = f"{r['pages']} ({r['page_size']})" if r["paged"] else ""
        used = f"{r['mean_pages_used']:.0f} / {r['peak_pages_used']}" if r["paged"] else ""
        lines.append(f"| {r['cache']} | {r['rows']} | {pages} | {r['mean_held']:.1f} | {r['peak_held']} | "
                     f"{r['tokens_per_s']:.1f} | {r['ttft_p50_s']:.2f} | {r['ttft_p99_s']:.2f} | {r['preemptions']} | "
                     f"{used} |")
    for name, ratio in result["ratios"].items():
        line = f"\n{name.replace('_over_', ' / ')}: whole run {ratio['mean_held']:.2f}x sequences held, " \
               f"{ratio['tokens_per_s']:.2f}x tokens/s, {ratio['requests_per_s']:.2f}x requests/s"
        if "steady_output_tokens_per_s" in ratio:
            line += (f"; steady {ratio['steady_mean_held']:.2f}x sequences held, "
                     f"{ratio['steady_output_tokens_per_s']:.2f}x output tokens/s, "
                     f"{ratio['steady_requests_per_s']:.2f}x requests/s")
            if "steady_output_tokens_per_engine_cpu_s" in ratio:
                line += f", {ratio['steady_output_tokens_per_engine_cpu_s']:.2f}x output tokens per engine CPU second"
        lines.append(line)
    for cache, why in result["skipped"].items():
        lines.append(f"\n{cache}: not run ({why})")
    return "\n".join(lines) + "\n"
