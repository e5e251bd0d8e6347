"""Tuning sweep of the fused decode attention kernels on a GPU (one device call): CUDA-graph
replay times (launch overhead excluded) of attend_decode (kivi_ops/kernels/triton/decode.py, what
the dispatcher runs for a decode step with head_dim 128) and of the tensor-core candidate
attend_decode_mma (triton_decode_mma.py) over launch configurations, beside SDPA over the fp16
cache of the same shape, with each compiled kernel's registers, spills and shared memory.


    python -m lab gpu_attend_sweep [contexts] [configs] [heads] [--json]

configs: "default" or a list "[kernel/]splits:block_n:warps:stages,...", kernel decode (the
default), mma or mma-magic (magic-number code conversion), or cuda (the CUDA C++ kernel,
kivi_ops/kernels/cuda; only its splits count, 0: its default); heads: "32/32" (query/kv, default),
e.g. "32/32,32/8". Prints a table; --json for rows."""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.nn.functional as F
from triton.testing import do_bench

from kivi_ops import KIVICache, KIVIConfig
from kivi_ops.kernels.cuda.attend import attend_cuda_cpp
from kivi_ops.kernels.triton import decode as triton_decode, split as triton_split
from lab import triton_decode_mma
from kivi_benchmarks.perf import attend_read_bytes, copy_bandwidth


def graph_us(fn, calls: int = 10) -> float:
    """Median microseconds per fn() over replays of a CUDA graph holding `calls` calls."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return do_bench(graph.replay, warmup=25, rep=150, return_mode="median") * 1e3 / calls


def kernel_info(jit_fn) -> list[dict]:
    out = []
    for caches in getattr(jit_fn, "device_caches", {}).values():
        for k in caches[0].values():
            md = k.metadata
            out.append(dict(regs=k.n_regs, spills=k.n_spills, shared=md.shared, warps=md.num_warps,
                            stages=md.num_stages))
    return out


def parse_config(spec: str) -> tuple[str, dict]:
    """"[kernel/]splits:block_n:warps:stages" -> (kernel, launcher keywords); splits 0: the launcher's choice."""
    kernel, _, knobs = spec.rpartition("/")
    kernel = kernel or "decode"
    if kernel not in ("decode", "mma", "mma-magic", "cuda"):
        raise SystemExit(f"config kernel must be decode, mma, mma-magic or cuda, got {kernel!r}")
    splits, block_n, warps, stages = (int(v) for v in knobs.split(":"))
    if kernel == "cuda":  # the CUDA C++ kernel (kivi_ops/kernels/cuda): its tiles and warps are fixed
        return kernel, dict(num_splits=splits or None)
    kw = dict(num_splits=splits or None, block_n=block_n, num_warps=warps, num_stages=stages)
    if kernel == "mma-magic":
        kw["magic"] = True
    return kernel, kw


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m lab gpu_attend_sweep", description=__doc__.split("\n\n")[0])
    parser.add_argument("contexts", nargs="?", default="2048,8192,32768")
    parser.add_argument("configs", nargs="?", default="default")
    parser.add_argument("heads", nargs="?", default="32/32")
    parser.add_argument("--head-dim", type=int, default=128, help="head_dim (256: Gemma's)")
    parser.add_argument("--batch", default="8", help="batch sizes, comma-separated (default 8)")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON at the end")
    args = parser.parse_args(argv)
    contexts = [int(x) for x in args.contexts.split(",")]
    configs = [None] if args.configs == "default" else [parse_config(c) for c in args.configs.split(",")]
    heads = [tuple(int(x) for x in h.split("/")) for h in args.heads.split(",")]
    D, bits = args.head_dim, 2
    bw = copy_bandwidth("cuda")
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {bw / 1e12:.2f} TB/s (read + write)")
    rows = []
    for B, (Hq, H), n in ((b, h, n) for b in map(int, args.batch.split(",")) for h in heads for n in contexts):
        k = torch.randn(B, H, n, D, device="cuda", dtype=torch.float16)
        v = torch.randn_like(k)
        q = torch.randn(B, Hq, 1, D, device="cuda", dtype=torch.float16)
        cache = KIVICache(KIVIConfig(bits, bits, 32, 128), num_layers=1, batch_size=B, max_seq_len=n,
                          num_kv_heads=H, head_dim=D, dtype=torch.float16, device="cuda")
        cache.layers[0].append(k, v)
        want = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), enable_gqa=True)
        sdpa = graph_us(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True))
        read = attend_read_bytes(cache, n)
        floor_us = read / bw * 1e6  # bw counts bytes read + written: the DRAM traffic rate
        layer, params = cache.layers[0].tensors(), cache.layers[0].params
        first = None
        for cfg in configs:
            kernel, kw = cfg or ("decode", {})
            launcher = (triton_decode_mma.attend_decode_mma if kernel.startswith("mma") else
                        attend_cuda_cpp if kernel == "cuda" else triton_decode.attend_decode)
            fn = lambda: launcher(q, layer, None, params, D ** -0.5, **kw)  # noqa: E731
            got = fn().float()
            err = ((got - want).norm() / want.norm()).item()
            first = first if cfg is not configs[0] else got  # every config must compute the same function
            diff = (got - first).abs().max().item()
            us = graph_us(fn)
            row = dict(heads=f"{Hq}/{H}", tokens=n, batch=B, config=cfg or "default", us=us, sdpa_us=sdpa, speedup=sdpa / us,
                       bandwidth_share=floor_us / us, rel_err_vs_fp=err, max_diff_vs_first_config=diff)
            if kernel == "cuda":  # which build of the CUDA C++ kernel ran (lab/cuda_decode_variants.py)
                from kivi_ops.kernels.cuda.loader import load

                row.update(cuda_variant=list(load().variant()), cuda_library=os.environ.get("KIVI_CUDA_DECODE_LIB"))
            rows.append(row)
            print(f"{Hq}/{H} n={n:>6} cfg={str(cfg or 'default'):>40}  {us:8.1f} us  SDPA {sdpa:8.1f} us  "
                  f"{sdpa / us:5.2f}x  bw share {floor_us / us:5.1%}  floor {floor_us:7.1f} us  err {err:.3f} "
                  f"diff {diff:.1e}",
                  flush=True)
        del k, v, cache
    for jit_fn in (triton_split._attend_split_kernel, triton_decode._attend_decode_kernel,
                   triton_decode_mma._attend_decode_mma_kernel):
        for info in kernel_info(jit_fn):
            print(jit_fn.__name__, info)
    if args.json:
        print(json.dumps(rows))
