"""CPU: the compiled decode step (one-token append + attend) of a paged KIVI layer against the
static KIVICache layer at the same rows and capacity, same run, methods interleaved.

    OMP_NUM_THREADS=1 .venv/bin/python -m lab paged_decode_cpu [--rows 32] [--context 1536]
        [--capacity 2048] [--repeats 10]

Shape: SmolLM2-135M's attention (9 query heads, 3 KV heads, head_dim 64, fp32), KIVI-2 G=32 R=128,
pages of 128 tokens handed out shuffled. Each method is torch.compile(fullgraph=True) of
`layer.append(k, v); return layer.attend(q)`; the outputs are checked equal (torch.equal) first.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch

from kivi_ops import KIVICache, KIVIConfig, Step
from kivi_ops.dispatch import implementations
from kivi_ops.cache.paged import PagedKIVICache


def build(rows, context, capacity, page_size, H, D, seed=0, R=128):
    cfg = KIVIConfig(k_bits=2, v_bits=2, group_size=32, residual_length=R)
    M = capacity // page_size
    static = KIVICache(cfg, num_layers=1, batch_size=rows, max_seq_len=capacity, num_kv_heads=H, head_dim=D,
                       dtype=torch.float32)
    paged = PagedKIVICache(cfg, num_layers=1, batch_size=rows, num_pages=rows * M + 7, page_size=page_size,
                           max_pages_per_seq=M, num_kv_heads=H, head_dim=D, dtype=torch.float32)
    free = list(range(paged.num_pages))
    random.Random(seed).shuffle(free)
    paged.block_table.copy_(torch.tensor(free[:rows * M], dtype=torch.int32).view(rows, M))
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([context - (i * 37) % 256 for i in range(rows)])
    k = torch.randn(rows, H, context, D, generator=g)
    v = torch.randn(rows, H, context, D, generator=g)
    step = Step(counts=lengths, prefill=True)
    with torch.no_grad():
        static.layers[0].append(k, v, step)
        paged.layers[0].append(k, v, step)
    return static, paged


def build_paged(rows, context, capacity, page_size, H, D, seed=0, R=128):
    return build(rows, context, capacity, page_size, H, D, seed, R)[1]


def _attend_fused_gathered(query, layer, counts, params, scale, pages):
    """decomposed_fused's paged form before the indexed view: on the pages gathered (static_view)."""
    from kivi_ops.kernels.decomposed.attend import attend_fused
    from kivi_ops.paged_layout import static_view

    return attend_fused(query, static_view(layer, pages.block_table), counts, params, scale)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--context", type=int, default=1536)
    ap.add_argument("--capacity", type=int, default=2048)
    ap.add_argument("--page-size", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--residual-length", type=int, default=128)
    ap.add_argument("--gathered", action="store_true", help="also time the paged step on gathered pages")
    args = ap.parse_args(argv)
    H, HQ, D = 3, 9, 64
    static, paged = build(args.rows, args.context, args.capacity, args.page_size, H, D, R=args.residual_length)

    def step(layer, key, value, query):
        layer.append(key, value)
        return layer.attend(query)

    gathered_step = torch.compile(step, fullgraph=True)

    def gathered(layer, key, value, query):
        """The paged attention on the pages gathered into the static layout (static_view): the
        form before the indexed view, kept here for the comparison."""
        table = implementations._TABLE["attend"]
        original = table["decomposed_fused"]
        table["decomposed_fused"] = original._replace(paged=_attend_fused_gathered)
        try:
            return gathered_step(layer, key, value, query)
        finally:
            table["decomposed_fused"] = original

    fns = {"static": (torch.compile(step, fullgraph=True), static.layers[0]),
           "paged": (torch.compile(step, fullgraph=True), paged.layers[0])}
    if args.gathered:
        fns["paged_gathered"] = (gathered, build_paged(args.rows, args.context, args.capacity, args.page_size, H,
                                                       D, R=args.residual_length).layers[0])
    g = torch.Generator().manual_seed(1)
    times = {name: [] for name in fns}
    compile_s = {}
    with torch.no_grad():
        for r in range(args.repeats + 2):
            k, v, q = (torch.randn(args.rows, H, 1, D, generator=g), torch.randn(args.rows, H, 1, D, generator=g),
                       torch.randn(args.rows, HQ, 1, D, generator=g))
            outs = {}
            for name, (fn, layer) in fns.items():
                t0 = time.perf_counter()
                outs[name] = fn(layer, k, v, q)
                dt = time.perf_counter() - t0
                if r == 0:
                    compile_s[name] = dt
                elif r >= 2:
                    times[name].append(dt)
            for name in outs:
                assert torch.equal(outs["static"], outs[name]), f"round {r}: {name} != static"
    med = {name: statistics.median(ts) for name, ts in times.items()}
    ratios = {name: round(statistics.median(p / s for p, s in zip(times[name], times["static"])), 3)
              for name in times if name != "static"}
    print(json.dumps({"rows": args.rows, "context": args.context, "capacity": args.capacity,
                      "threads": torch.get_num_threads(), "median_ms": {n: round(1e3 * m, 2) for n, m in med.items()},
                      "over_static_median_ratio": ratios,
                      "first_call_s": {n: round(s, 1) for n, s in compile_s.items()}}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
