"""`kivi bench hf-generate`: transformers' own `model.generate()`, one cache against another.

What a Hugging Face user gets from the README's example: the same model and prompts through
`model.generate()` with transformers' default DynamicCache, its QuantizedCache (quanto, 2-bit,
when optimum-quanto is installed), and our KIVI-2 cache with compiled decode steps (the default)
and eager ones (`disable_compile=True`). Prompts are real text (Python's pydoc topics), greedy,
every row the same length (no padding), each point in one run.

Each point runs at every thread count asked for (`threads`, e.g. [1, 2]; default torch's own, one
per core, which is what a user gets), one after the other for the same prompts; each row records
its count, so a ratio is always read between caches at the same thread count.

Decode speed comes from the time between consecutive decode steps (a logits processor stamps
each step): tokens/s = batch / median step time after the warm-up steps, which hold the compile.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from typing import Callable, Optional

import torch
from transformers import LogitsProcessor, LogitsProcessorList

from kivi_models import make_cache, patch_model
from kivi_models.corpus import load_text
from kivi_ops import KIVIConfig

from .environment import environment
from .perf import kivi_bits

CACHES = ("dynamic", "quanto", "kivi_eager", "kivi")
WARMUP_STEPS = 3  # the first decode steps: the compile of "kivi", allocator warm-up for every cache


def quanto_available() -> bool:
    try:
        import optimum.quanto  # noqa: F401
    except ImportError:
        return False
    return True


class StepClock(LogitsProcessor):
    """Stamps the time of every generated token (transformers calls it once per step)."""

    def __init__(self):
        self.stamps: list[float] = []

    def __call__(self, input_ids, scores):
        self.stamps.append(time.perf_counter())
        return scores


def pydoc_prompts(tokenizer, batch: int, tokens: int) -> torch.Tensor:
    """[batch, tokens] of consecutive pydoc text, a different stretch per row."""
    ids = tokenizer(load_text(corpus="pydoc"), add_special_tokens=False)["input_ids"]
    if len(ids) < batch * tokens:
        raise ValueError(f"the pydoc text has {len(ids)} tokens, fewer than batch x context = {batch * tokens}")
    return torch.tensor(ids[: batch * tokens]).reshape(batch, tokens)


def measure(model, prompts: torch.Tensor, *, cache: str, new_tokens: int, kivi_config: KIVIConfig) -> dict:
    """One generate() call: median decode step -> tokens/s, the new tokens of row 0."""
    B, n = prompts.shape
    kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                  attention_mask=torch.ones_like(prompts), pad_token_id=0)
    if cache == "quanto":
        kwargs.update(cache_implementation="quantized", cache_config={"backend": "quanto", "nbits": 2})
    elif cache.startswith("kivi"):
        kwargs["past_key_values"] = make_cache(model, method="kivi", batch_size=B, max_seq_len=n + new_tokens,
                                               kivi_config=kivi_config)
        kwargs["disable_compile"] = cache == "kivi_eager"
    clock = StepClock()
    start = time.perf_counter()
    out = model.generate(prompts, logits_processor=LogitsProcessorList([clock]), **kwargs)
    steps = [b - a for a, b in zip(clock.stamps, clock.stamps[1:])][WARMUP_STEPS:]
    return dict(tokens_per_s=B / statistics.median(steps), mean_step_s=statistics.fmean(steps),
                prefill_s=clock.stamps[0] - start, warmup_s=clock.stamps[WARMUP_STEPS] - clock.stamps[0],
                timed_steps=len(steps), tokens=out[0, n:].tolist())


def bench_hf_generate(plain_model, tokenizer, *, contexts, batches, new_tokens: int = 64,
                      caches: Optional[list[str]] = None, kivi_config: Optional[KIVIConfig] = None,
                      rounds: int = 1, threads: Optional[list[int]] = None,
                      on_row: Optional[Callable[[dict], None]] = None) -> dict:
    """Decode tokens/s of model.generate() per cache, at each (batch, context), side by side: the
    caches take turns `rounds` times, and each cache's fastest run is its result (all runs' tokens/s
    are kept under "rounds_tokens_per_s"). One row per (batch, context, thread count); the thread
    count torch had before is restored at the end. on_row(result so far, "complete": False) after
    each row: an 8K batch-4 point takes minutes a run on CPU, and a run cut off keeps its rows."""
    import copy

    default_threads = torch.get_num_threads()
    threads = list(threads or [default_threads])
    if not threads or not all(isinstance(t, int) and not isinstance(t, bool) and t > 0 for t in threads):
        raise ValueError(f"threads must be a list of positive ints (torch CPU threads), got {threads!r}")

    kivi_config = kivi_config or KIVIConfig()
    caches = [c for c in (caches or CACHES) if c != "quanto" or quanto_available()]
    kivi_model = patch_model(copy.deepcopy(plain_model)) if any(c.startswith("kivi") for c in caches) else None
    max_context = plain_model.config.max_position_embeddings - new_tokens
    load_before = os.getloadavg()
    rows = []

    def result(complete: bool) -> dict:
        env = environment("cpu" if plain_model.device.type == "cpu" else "cuda")
        env.update(load_average_before=load_before, load_average_after=os.getloadavg(), quanto=_quanto_version())
        return dict(device=plain_model.device.type, dtype=str(plain_model.dtype), caches=caches, threads=threads,
                    kivi=kivi_config.to_dict(), warmup_steps=WARMUP_STEPS, rows=list(rows), complete=complete,
                    environment=env)

    try:
        for batch in batches:
            for context in contexts:
                n = min(context, max_context)  # the model's positions bound prompt + new tokens
                prompts = pydoc_prompts(tokenizer, batch, n)
                for count in threads:
                    torch.set_num_threads(count)
                    rows.append(_measure_row(plain_model, kivi_model, prompts, caches=caches, new_tokens=new_tokens,
                                             kivi_config=kivi_config, rounds=rounds, threads=count))
                    if on_row is not None:
                        on_row(result(complete=False))
    finally:
        torch.set_num_threads(default_threads)
    return result(complete=True)


def _measure_row(plain_model, kivi_model, prompts, *, caches, new_tokens, kivi_config, rounds, threads) -> dict:
    """One (batch, context) point at the current thread count: the caches take turns `rounds` times."""
    batch, n = prompts.shape
    row = dict(batch=batch, context=n, threads=threads, new_tokens=new_tokens,
               **(kivi_bits(kivi_model, kivi_config, n + new_tokens) if kivi_model is not None else {}))
    runs = {cache: [] for cache in caches}
    for _ in range(rounds):
        for cache in caches:
            torch.compiler.reset()  # each row compiles its own shapes: no recompile limit
            model = kivi_model if cache.startswith("kivi") else plain_model
            m = measure(model, prompts, cache=cache, new_tokens=new_tokens, kivi_config=kivi_config)
            runs[cache].append(m)
            print(f"  batch {batch} context {n} threads {threads} {cache}: {m['tokens_per_s']:.1f} tok/s (prefill "
                  f"{m['prefill_s']:.1f} s, warm-up {m['warmup_s']:.1f} s)", file=sys.stderr, flush=True)
    for cache in caches:
        row[cache] = max(runs[cache], key=lambda m: m["tokens_per_s"])
        row[cache]["rounds_tokens_per_s"] = [m["tokens_per_s"] for m in runs[cache]]
    for cache in caches:
        row[cache]["vs_dynamic"] = row[cache]["tokens_per_s"] / row["dynamic"]["tokens_per_s"]
    row["load_average"] = os.getloadavg()[0]
    return row


def _quanto_version() -> Optional[str]:
    if not quanto_available():
        return None
    from importlib.metadata import version

    return version("optimum-quanto")


def print_hf_generate(result: dict) -> None:
    caches = result["caches"]
    print("decode tokens/s of model.generate() (median step after warm-up), and / DynamicCache")
    print("batch  context  threads  " + "  ".join(f"{c:>18}" for c in caches))
    for r in result["rows"]:
        cells = [f"{r[c]['tokens_per_s']:>9.1f} ({r[c]['vs_dynamic']:.2f}x)" for c in caches]
        print(f"{r['batch']:>5} {r['context']:>8} {r.get('threads', '?'):>8}  " + "  ".join(f"{c:>18}" for c in cells))


def plot_hf_generate(result: dict, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows, caches = result["rows"], result["caches"]
    labels = {"dynamic": "DynamicCache (fp)", "quanto": "QuantizedCache (quanto, 2-bit)",
              "kivi_eager": "KIVI-2, eager", "kivi": "KIVI-2, compiled (default)"}
    fig, ax = plt.subplots(figsize=(7, 4))
    points = [f"batch {r['batch']}\n{r['context']} tokens\n{r.get('threads', '?')} thr." for r in rows]
    width = 0.8 / len(caches)
    for i, cache in enumerate(caches):
        ax.bar([p + i * width for p in range(len(rows))], [r[cache]["tokens_per_s"] for r in rows], width,
               label=labels.get(cache, cache))
    ax.set_xticks([p + width * (len(caches) - 1) / 2 for p in range(len(rows))], points)
    ax.set_ylabel("decode tokens/s")
    ax.set_title(f"model.generate(), greedy ({result['device']}, {result['dtype']})")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
