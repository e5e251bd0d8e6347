"""Decode step time of the two CPU compile modes side by side: one decoder layer compiled and run
for every layer (regional, the default) vs the whole step as one graph, for the fp and KIVI-2
caches, the four variants alternating step by step (the machine's noise hits all alike), median step.

    .venv/bin/python -m lab compile_modes_cpu --context 1024 --batch 1 --rounds 40
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch

from kivi_models import compile_decode_step, load_model, make_cache, patch_model

from kivi_benchmarks.environment import environment
from kivi_benchmarks.perf import fill_cache_randomly, interleaved_times


def measure(context: int, batch: int, rounds: int, modes=("regional", "whole")) -> dict:
    model, _ = load_model()
    patch_model(model)
    variants = {}
    with torch.inference_mode():
        for method in ("fp", "kivi"):
            for mode in modes:
                regional = mode == "regional"
                name = f"{method}-{mode}"
                cache = make_cache(model, method=method, batch_size=batch, max_seq_len=context + rounds + 8)
                gen = torch.Generator().manual_seed(0)
                fill_cache_randomly(cache, context, gen)
                step = compile_decode_step(torch.device("cpu"), regional=regional)
                tokens = torch.randint(3, model.config.vocab_size, (batch,), generator=gen)
                positions = torch.full((batch,), context, dtype=torch.int64)
                start = time.perf_counter()
                for _ in range(2):
                    tokens = step(model, cache, tokens, positions).argmax(-1)
                    positions += 1
                variants[name] = dict(cache=cache, step=step, tokens=tokens, positions=positions,
                                      compile_and_2_steps_s=time.perf_counter() - start)
                print(f"{name}: compile + 2 steps {variants[name]['compile_and_2_steps_s']:.1f} s", flush=True)

        def one_step(v):
            def run():
                v["tokens"] = v["step"](model, v["cache"], v["tokens"], v["positions"]).argmax(-1)
                v["positions"] += 1
            return run

        times = interleaved_times({name: one_step(v) for name, v in variants.items()}, "cpu", rounds)
    ms = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    return dict(context=context, batch=batch, rounds=rounds, median_step_ms=ms,
                compile_and_2_steps_s={n: v["compile_and_2_steps_s"] for n, v in variants.items()},
                **{f"kivi_over_fp_{m}": ms[f"fp-{m}"] / ms[f"kivi-{m}"] for m in modes},
                **({} if len(modes) < 2 else dict(regional_over_whole_kivi=ms["kivi-whole"] / ms["kivi-regional"],
                                                  regional_over_whole_fp=ms["fp-whole"] / ms["fp-regional"])))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m lab compile_modes_cpu", description=__doc__.split("\n\n")[0])
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--modes", default="regional,whole",
                        help="comma-separated: regional (one layer compiled, the CPU default), whole (the step)")
    parser.add_argument("--out", default=None, help="write the JSON here as well")
    args = parser.parse_args(argv)
    modes = tuple(args.modes.split(","))
    if not modes or set(modes) - {"regional", "whole"}:
        parser.error(f"--modes takes regional and/or whole, got {args.modes!r}")
    result = measure(args.context, args.batch, args.rounds, modes)
    result["environment"] = environment(command="python -m lab compile_modes_cpu " + " ".join(argv or []))
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
