"""Where a graph-replayed decode step spends its GPU time, fp static cache against KIVI-2: the
Llama-2-7B shape (random fp16 weights), batch 1, a cache filled with `--context` random tokens,
the compiled step (CUDA graphs), then torch.profiler over `--steps` steps. Prints each cache's
kernels by total GPU time and writes the tables (and a JSON summary) to --out.

    python -m lab gpu_profile_step [--context 1024] [--steps 20] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from kivi_ops import KIVIConfig


def llama2_7b_shape():
    from transformers import LlamaConfig, LlamaForCausalLM

    from kivi_models import patch_model

    config = LlamaConfig(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=32, vocab_size=32000, max_position_embeddings=131072)
    with torch.device("cuda"):
        model = LlamaForCausalLM(config).to(torch.float16).eval()
    return patch_model(model)


def profile_method(model, method: str, context: int, steps: int) -> tuple[str, dict]:
    from kivi_benchmarks.perf import fill_cache_randomly
    from kivi_models import compile_decode_step, make_cache

    torch.compiler.reset()
    cache = make_cache(model, method=method, batch_size=1, max_seq_len=context + steps + 8, kivi_config=KIVIConfig())
    gen = torch.Generator(device="cuda").manual_seed(0)
    with torch.inference_mode():
        fill_cache_randomly(cache, context, gen)
        step = compile_decode_step(torch.device("cuda"))
        tokens = torch.randint(3, model.config.vocab_size, (1,), generator=gen, device="cuda")
        positions = torch.full((1,), context, dtype=torch.int64, device="cuda")
        for _ in range(4):  # compile, record the graph, replay
            tokens = step(model, cache, tokens, positions).argmax(dim=-1)
            positions += 1
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(steps):
            tokens = step(model, cache, tokens, positions).argmax(dim=-1)
            positions += 1
        end.record()
        torch.cuda.synchronize()
        step_ms = start.elapsed_time(end) / steps
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                tokens = step(model, cache, tokens, positions).argmax(dim=-1)
                positions += 1
            torch.cuda.synchronize()
    averages = prof.key_averages()
    # GPU-side events only (kernels, copies, memsets); CPU ops carry their kernels' time again.
    events = [e for e in averages if e.device_type == torch.autograd.DeviceType.CUDA and e.device_time_total > 0]
    kernel_us = sum(e.device_time_total for e in events)
    table = averages.table(sort_by="device_time_total", row_limit=30, max_name_column_width=90)
    summary = dict(method=method, context=context, steps=steps, step_ms=step_ms,
                   gpu_kernel_ms_per_step=kernel_us / 1e3 / steps,
                   top=[dict(name=e.key[:120], calls_per_step=e.count / steps, us_per_step=e.device_time_total / steps)
                        for e in sorted(events, key=lambda e: -e.device_time_total)[:25]])
    return table, summary


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m lab gpu_profile_step", description=__doc__.split("\n\n")[0])
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    model = llama2_7b_shape()
    summaries = []
    for method in ("fp", "kivi"):
        table, summary = profile_method(model, method, args.context, args.steps)
        summaries.append(summary)
        print(f"--- {method}: {summary['step_ms']:.3f} ms per step (events), GPU kernels "
              f"{summary['gpu_kernel_ms_per_step']:.3f} ms per step")
        for row in summary["top"][:12]:
            print(f"  {row['us_per_step']:9.1f} us  x{row['calls_per_step']:6.1f}  {row['name'][:100]}")
        if args.out:
            (args.out / f"profile_{method}_{args.context}.txt").write_text(table)
    if args.out:
        (args.out / f"profile_step_{args.context}.json").write_text(json.dumps(summaries, indent=1))


if __name__ == "__main__":
    main()
