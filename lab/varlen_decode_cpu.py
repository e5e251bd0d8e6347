"""`python -m lab varlen_decode_cpu [--tokens L] [--kernels compiled|reference]`: one KIVI-2 layer's
decode step through kivi_ops.cache.varlen (what the vLLM backend runs per layer), batch 8, SmolLM2's shape
(3 KV heads, 9 query heads, head_dim 64, R = 128, G = 32, pages of 32), on byte pages; and fp32 SDPA
over the same lengths beside it. One thread. The step's plan (varlen.plan: the metadata read once
per step, for every layer) is timed apart from the layer's run."""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from kivi_ops import KIVIConfig, dispatch
from kivi_ops.cache.byte_pages import page_bytes, pool_views
from kivi_ops.layout import LayerTensors, QuantParams
from kivi_ops.cache import varlen

H, HQ, D, PS, B, R = 3, 9, 64, 32, 8, 128


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=500)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--kernels", choices=dispatch.CPU_KERNELS, default="compiled")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    config = KIVIConfig(k_bits=2, v_bits=2, group_size=32, residual_length=R)
    per_row = (args.tokens + args.steps + 2 * PS) // PS
    buffer = torch.zeros(1 + B * per_row, page_bytes(config, H, PS, D, torch.float32), dtype=torch.uint8)
    pools = pool_views(buffer, config, H, PS, D, torch.float32)
    table = torch.tensor([[1 + r * per_row + j for j in range(per_row)] for r in range(B)], dtype=torch.int32)
    kw, vw = torch.zeros(B, H, R, D), torch.zeros(B, H, R, D)
    layer = LayerTensors(pools["k_codes"], pools["k_scale"], pools["k_zero"], kw, pools["v_codes"], pools["v_scale"],
                         pools["v_zero"], vw, torch.zeros(B, dtype=torch.long))
    params = QuantParams(2, 2, 32, R)

    times = {"plan": 0.0, "run": 0.0}

    def step(lengths, n):
        qsl = torch.arange(B + 1) * n
        pos = torch.cat([torch.arange(length, length + n) for length in lengths])
        owner = torch.arange(B).repeat_interleave(n)
        slots = table.long()[owner, pos // PS] * PS + pos % PS
        q, k, v = torch.randn(B * n, HQ, D), torch.randn(B * n, H, D), torch.randn(B * n, H, D)
        t0 = time.perf_counter()
        plan = varlen.plan(torch.arange(B), table, qsl, torch.tensor(lengths) + n, slots, PS, R, B)
        t1 = time.perf_counter()
        varlen.run(plan, q, k, v, layer, kw, vw, params, D ** -0.5)
        times["plan"] += t1 - t0
        times["run"] += time.perf_counter() - t1

    with dispatch.cpu_kernels(args.kernels):
        step([0] * B, args.tokens)
        lengths = [args.tokens] * B
        step(lengths, 1)  # compiles this bucket (untimed)
        lengths = [n + 1 for n in lengths]
        times.update(plan=0.0, run=0.0)
        for _ in range(args.steps):
            step(lengths, 1)
            lengths = [n + 1 for n in lengths]
        plan_s, kivi = times["plan"] / args.steps, times["run"] / args.steps
    q, k, v = torch.randn(B, HQ, 1, D), torch.randn(B, H, args.tokens, D), torch.randn(B, H, args.tokens, D)
    start = time.perf_counter()
    for _ in range(args.steps):
        F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    sdpa = (time.perf_counter() - start) / args.steps
    print(f"{args.kernels}: KIVI-2 varlen decode {kivi * 1e3:.2f} ms per layer (+ {plan_s * 1e3:.2f} ms per step "
          f"to plan) at {args.tokens} tokens, batch {B}; fp32 SDPA {sdpa * 1e3:.2f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
