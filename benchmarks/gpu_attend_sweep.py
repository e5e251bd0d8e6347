"""Tuning sweep of the fused decode attention kernel on a GPU (one device call): CUDA-graph
replay times (launch overhead excluded) of attend_decode (kivi_ops/kernels/triton_decode.py, what
the dispatcher runs for a decode step with head_dim 128) over launch configurations,
beside SDPA over the fp16 cache of the same shape, with each compiled kernel's registers,
spills and shared memory. Usage: python3 benchmarks/gpu_attend_sweep.py [contexts] [configs]
configs: "default" or a list "splits:block_n:warps:stages,...". Prints a table; --json for rows."""

from __future__ import annotations

import json
import sys

import torch
import torch.nn.functional as F
from triton.testing import do_bench

from kivi_ops import KIVICache, KIVIConfig
from kivi_ops.kernels import triton_decode, triton_split
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


def main():
    contexts = [int(x) for x in (sys.argv[1] if len(sys.argv) > 1 else "2048,8192,32768").split(",")]
    spec = sys.argv[2] if len(sys.argv) > 2 else "default"
    configs = [None] if spec == "default" else [tuple(int(v) for v in c.split(":")) for c in spec.split(",")]
    B, H, D, bits = 8, 32, 128, 2
    bw = copy_bandwidth("cuda")
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {bw / 1e12:.2f} TB/s (read + write)")
    rows = []
    for n in contexts:
        k = torch.randn(B, H, n, D, device="cuda", dtype=torch.float16)
        v = torch.randn_like(k)
        q = torch.randn(B, H, 1, D, device="cuda", dtype=torch.float16)
        cache = KIVICache(KIVIConfig(bits, bits, 32, 128), num_layers=1, batch_size=B, max_seq_len=n,
                          num_kv_heads=H, head_dim=D, dtype=torch.float16, device="cuda")
        cache.append(0, k, v)
        want = F.scaled_dot_product_attention(q.float(), k.float(), v.float())
        sdpa = graph_us(lambda: F.scaled_dot_product_attention(q, k, v))
        read = attend_read_bytes(cache, n)
        floor_us = read / bw * 1e6  # bw counts bytes read + written: the DRAM traffic rate
        layer, params = cache.layer_tensors(0), cache.layers[0].params
        first = None
        for cfg in configs:
            kw = {} if cfg is None else dict(num_splits=cfg[0] or None, block_n=cfg[1], num_warps=cfg[2],
                                             num_stages=cfg[3])  # splits 0: the launcher's choice
            fn = lambda: triton_decode.attend_decode(q, layer, None, params, D ** -0.5, **kw)  # noqa: E731
            got = fn().float()
            err = ((got - want).norm() / want.norm()).item()
            first = first if cfg is not configs[0] else got  # every config must compute the same function
            diff = (got - first).abs().max().item()
            us = graph_us(fn)
            row = dict(tokens=n, config=cfg or "default", us=us, sdpa_us=sdpa, speedup=sdpa / us,
                       bandwidth_share=floor_us / us, rel_err_vs_fp=err, max_diff_vs_first_config=diff)
            rows.append(row)
            print(f"n={n:>6} cfg={str(cfg or 'default'):>18}  {us:8.1f} us  SDPA {sdpa:8.1f} us  "
                  f"{sdpa / us:5.2f}x  bw share {floor_us / us:5.1%}  floor {floor_us:7.1f} us  err {err:.3f} "
                  f"diff {diff:.1e}",
                  flush=True)
        del k, v, cache
    for jit_fn in (triton_split._attend_split_kernel, triton_decode._attend_decode_kernel):
        for info in kernel_info(jit_fn):
            print(jit_fn.__name__, info)
    if "--json" in sys.argv:
        print(json.dumps(rows))


if __name__ == "__main__":
    main()
