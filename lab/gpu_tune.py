"""Measure the decode-attention tuning table on a GPU (one device call, well under 2 minutes on an
H200): for each shape class that serving and the benchmarks use, every kernel dispatch.py finds
eligible there (decode_candidates under KIVI_CUDA_DECODE=auto) is timed by CUDA-graph replay (as
gpu_attend_sweep times them, which seeded the table), and the fastest is written per class.

    KIVI_GIT_SHA=$(git rev-parse HEAD) python -m lab gpu_tune --out DIR [--budget-s 90]

DIR/tuning_table.json is kivi_ops/dispatch/tuning_table.json with this device's entries measured now (the
other devices', and this device's classes not measured this time, kept): commit it over the
package's copy. The shape classes, most important first (a run cut by --budget-s keeps those):
batch 8 and 1, contexts 1K / 4K / 32K, heads 32/32 x 128 (Llama-2-7B, `kivi bench attention` and
`decode`), 32/8 x 128 (GQA 4:1) and 9/3 x 64 (the default SmolLM2 model that `kivi serve` runs),
KIVI-2 G=32 R=128 fp16, static; then the paged cache (page size 128) for the GQA shapes serving runs.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import time
from pathlib import Path

import torch

from kivi_ops import KIVICache, KIVIConfig, PagedKIVICache, dispatch
from kivi_ops.dispatch import tuning
from kivi_ops.dispatch import implementations
from kivi_ops.paged_layout import Paging

CONFIG = KIVIConfig(2, 2, 32, 128)
PAGE_SIZE = 128
BATCHES = (8, 1)
CONTEXTS = (1024, 4096, 32768)
HEADS = ((32, 32, 128), (32, 8, 128), (9, 3, 64))  # query heads, kv heads, head_dim
PAGED_HEADS = ((32, 8, 128), (9, 3, 64))


def shapes():
    """(batch, context, query heads, kv heads, head_dim, paged), most important first."""
    for paged, heads in ((False, HEADS), (True, PAGED_HEADS)):
        for (Hq, H, D), B, n in itertools.product(heads, BATCHES, CONTEXTS):
            yield B, n, Hq, H, D, paged


def filled_cache(B, n, H, D, paged, device="cuda"):
    """A one-layer KIVI-2 cache holding n random tokens per row (paged: pages in row order)."""
    k = torch.randn(B, H, n, D, device=device, dtype=torch.float16)
    v = torch.randn_like(k)
    common = dict(num_layers=1, batch_size=B, num_kv_heads=H, head_dim=D, dtype=torch.float16, device=device)
    if paged:
        pages = n // PAGE_SIZE
        cache = PagedKIVICache(CONFIG, num_pages=B * pages, page_size=PAGE_SIZE, max_pages_per_seq=pages, **common)
        cache.block_table.copy_(torch.arange(B * pages, dtype=cache.block_table.dtype).view(B, pages))
    else:
        cache = KIVICache(CONFIG, max_seq_len=n, **common)
    cache.layers[0].append(k, v)
    return cache


def measure(B, n, Hq, H, D, paged, graph_us, device="cuda") -> dict:
    """One shape class's entry: every eligible kernel's time (graph_us(fn): microseconds), the
    fastest named. device: "cuda" (tests drive it on CPU with fake kernels)."""
    cache = filled_cache(B, n, H, D, paged, device)
    layer, params = cache.layers[0].tensors(), cache.layers[0].params
    pages = Paging(cache.block_table, PAGE_SIZE) if paged else None
    q = torch.randn(B, Hq, 1, D, device=device, dtype=torch.float16)
    rule = dispatch.choose("attend", device="cuda", mode="eager", q_len=1, layer=layer).implementation
    us = {}
    for c in dispatch.decode_candidates(layer, params, Hq, paged, rule):
        us[c] = graph_us(lambda c=c: implementations.run_attend(c.implementation, q, layer, None, params, D ** -0.5,
                                                     pages=pages, launch=c.launch))
    best = min(us, key=us.__getitem__)
    cls = tuning.shape_class(batch=B, kv_heads=H, context=n, query_heads=Hq, head_dim=D, k_bits=CONFIG.k_bits,
                             v_bits=CONFIG.v_bits, dtype=torch.float16, paged=paged)
    return dict(cls._asdict(), implementation=best.implementation, launch=dict(best.launch),
                us={c.label(): round(t, 1) for c, t in us.items()})


def merged_table(device: str, source: dict, entries: list[dict]) -> dict:
    """The package's table with this device's entries measured now (its unmeasured classes kept)."""
    table = json.loads(tuning.TABLE_PATH.read_text())
    measured = {tuning.entry_key(e) for e in entries}
    kept = [e for e in table["devices"].get(device, {}).get("entries", []) if tuning.entry_key(e) not in measured]
    table["devices"][device] = dict(source=source, entries=entries + kept)
    return table


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m lab gpu_tune", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, type=Path, help="folder for tuning_table.json")
    parser.add_argument("--budget-s", type=float, default=90.0,
                        help="start no new shape class after this many seconds (default 90)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("python -m lab gpu_tune: needs a CUDA GPU (torch.cuda.is_available() is False): it times "
                         "the CUDA decode kernels; on CPU there is nothing to tune")
    from lab.gpu_attend_sweep import graph_us  # imports Triton's testing helpers: GPU only

    start, device = time.monotonic(), torch.cuda.get_device_name()
    previous = dispatch.set_cuda_decode("auto")
    entries, skipped = [], []
    try:
        for shape in shapes():
            if time.monotonic() - start > args.budget_s:
                skipped.append(shape)
                continue
            entry = measure(*shape, graph_us)
            entries.append(entry)
            torch.cuda.empty_cache()
            print(f"B={shape[0]} n={shape[1]} heads {shape[2]}/{shape[3]} x {shape[4]} paged={shape[5]}: "
                  f"{entry['implementation']}{entry['launch'] or ''}  {entry['us']}", flush=True)
    finally:
        dispatch.set_cuda_decode(previous)
    import triton

    source = dict(command="python -m lab gpu_tune", git_sha=os.environ.get("KIVI_GIT_SHA", "unknown"),
                  date=time.strftime("%Y-%m-%d"), versions=dict(torch=torch.__version__, triton=triton.__version__),
                  setup=f"KIVI-2 G=32 R=128 fp16, paged page size {PAGE_SIZE}, CUDA-graph replay (median of do_bench, "
                        "lab/gpu_attend_sweep.graph_us)",
                  not_measured=[dict(zip(("batch", "context", "query_heads", "kv_heads", "head_dim", "paged"), s))
                                for s in skipped])
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "tuning_table.json"
    path.write_text(json.dumps(merged_table(device, source, entries), indent=1) + "\n")
    print(f"{len(entries)} shape classes measured, {len(skipped)} cut by --budget-s, in "
          f"{time.monotonic() - start:.0f} s: {path}")
