"""PNG plots of the performance results (matplotlib, headless)."""

from __future__ import annotations

from pathlib import Path


def plot_bench(name: str, result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    if name.startswith("bench_budget"):
        _plot_budget(plt, result, path)
        return
    fig, ax = plt.subplots(figsize=(6.5, 4))
    if name == "bench_memory":
        configs = sorted({(r["bits"], r["group_size"], r["residual_length"]) for r in rows})
        for bits, G, R in configs:
            sel = [r for r in rows if (r["bits"], r["group_size"], r["residual_length"]) == (bits, G, R)]
            ax.plot([r["tokens"] for r in sel], [r["ratio"] for r in sel], marker="o", label=f"{bits}-bit G={G} R={R}")
        ax.set_ylabel("fp16 bytes / KIVI bytes")
        ax.set_title("KV-cache compression (Llama-2-7B shape, fp16 scales)")
    elif name.startswith("bench_attention"):
        for bits in sorted({r["bits"] for r in rows}):
            sel = [r for r in rows if r["bits"] == bits]
            ax.plot([r["tokens"] for r in sel], [r["speedup"] for r in sel], marker="o", label=f"KIVI-{bits}")
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set_ylabel("SDPA time / fused KIVI time")
        ax.set_title(f"Decode attention vs SDPA ({result['device']})")
    else:
        for batch in sorted({r["batch"] for r in rows}):
            sel = [r for r in rows if r["batch"] == batch]
            ax.plot([r["context"] for r in sel], [r["fp_tokens_per_s"] for r in sel], marker="s", ls="--",
                    label=f"fp, batch {batch}")
            ax.plot([r["context"] for r in sel], [r["kivi_tokens_per_s"] for r in sel], marker="o",
                    label=f"KIVI-2, batch {batch}")
        ax.set_ylabel("decode tokens/s")
        ax.set_title(f"Compiled decode ({result['device']}, {result.get('model', '')})")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context (tokens)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plot_budget(plt, result: dict, path: Path) -> None:
    """Two panels per context: the batch each cache fits in the budget, and the throughput at it."""
    rows = result["rows"]
    fig, axes = plt.subplots(1, 2, figsize=(8, 3.6))
    x = range(len(rows))
    for ax, key, label in ((axes[0], "batch", "largest batch in budget"),
                           (axes[1], "median_step_tokens_per_s", "decode tokens/s at that batch")):
        ax.bar([i - 0.2 for i in x], [r[f"fp_{key}"] for r in rows], width=0.4, label="fp16 static cache")
        ax.bar([i + 0.2 for i in x], [r[f"kivi_{key}"] for r in rows], width=0.4, label="KIVI-2")
        ax.set_xticks(list(x), [f"{r['context']} tokens" for r in rows])
        ax.set_ylabel(label)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"Cache budget {result['budget_gib']} GiB ({result['device']}, {result.get('model', '')})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
