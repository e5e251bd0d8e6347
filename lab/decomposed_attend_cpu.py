"""On CPU: can compiled KIVI-2 decode attention beat compiled fp32 SDPA over a
static fp32 cache?

One run, side by side, same shapes (the default model's attention: SmolLM2-135M, B=4, 9 query
heads, 3 KV heads, head_dim 64, fp32), context 8192, KIVI-2 with G=32, R=128:

    (a) sdpa_compiled      torch.compile of fp32 SDPA decode over a [B, H, S, D] cache, length mask
                           (what kivi_ops/cache/fp_layer.py does)
    (b) kivi_op            torch.ops.kivi.cache_attend: the custom op (CPU reference kernel)
    (c) decomposed_fused   torch.compile of cache_attend_decomposed (q_len 1: fused packed loops)
    (d) decomposed_matmul  torch.compile of cache_attend_decomposed(form="materialized")
                           (dequantize to fp32 + matmuls, for comparison)

and, for the other half of a decode step, one-token appends: torch.ops.kivi.cache_append (CPU
reference) vs torch.compile of cache_append_decomposed vs an fp32 cache's index_put_.

Timings: median of `--repeats` wall-clock runs per method after warm-up, methods interleaved
round by round (so a noisy neighbour hits all of them alike); the per-round ratios' median is
reported too. Inputs are random normal data, never zeros.

    .venv/bin/python -m lab decomposed_attend_cpu [--threads 1] [--context 8192] [--repeats 30] [--aten-byte-loads]

Each thread count wants its own process (Inductor specializes its loops to the thread count).
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics

import torch
import torch.nn.functional as F

from kivi_ops import KIVICache, KIVIConfig
from kivi_ops.kernels.decomposed.avx2_byte_loads import install as install_avx2_byte_loads
from kivi_ops.kernels.decomposed.append import append_decomposed
from kivi_ops.kernels.decomposed.attend import attend_fused, attend_materialized

from kivi_benchmarks.environment import environment
from kivi_benchmarks.perf import interleaved_times


def sdpa_decode(query, k, v, lengths, scale):
    """fp32 static-cache decode attention, as kivi_ops/cache/fp_layer.py: mask t < lengths."""
    t = torch.arange(k.shape[2], device=query.device)
    visible = t[None, :] < lengths[:, None]
    return F.scaled_dot_product_attention(query, k, v, attn_mask=visible[:, None, None, :], scale=scale,
                                          enable_gqa=True)


def fp_append(k_cache, v_cache, lengths, key, value):
    """One-token append to a static fp32 cache with index_put_ (Inductor re-inplaces it; a
    scatter_ on the cache inputs, as kivi_ops/cache/fp_layer.py writes it, compiles standalone here to
    full copies of both caches, ~50 ms at this shape)."""
    B, H = key.shape[:2]
    b = torch.arange(B, device=key.device)[:, None]
    h = torch.arange(H, device=key.device)[None, :]
    pos = lengths[:, None].expand(B, H)
    k_cache.index_put_((b, h, pos), key[:, :, 0])
    v_cache.index_put_((b, h, pos), value[:, :, 0])
    lengths += 1


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m lab decomposed_attend_cpu", description=__doc__.split("\n\n")[0])
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--q-heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--bits", type=int, default=2)
    ap.add_argument("--group-size", type=int, default=32)
    ap.add_argument("--residual-length", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--threads", type=int, default=None,
                    help="torch.set_num_threads before anything is compiled (default: torch's default)")
    ap.add_argument("--json", help="also write the results here")
    ap.add_argument("--aten-byte-loads", action="store_true",
                    help="compile with Inductor's own 8-byte loads (ATen's slow AVX2 path), not the library's "
                         "(kivi_ops/kernels/decomposed/avx2_byte_loads.py), to compare")
    args = ap.parse_args(argv)
    if not args.aten_byte_loads:
        install_avx2_byte_loads()  # what every compile of the library does (compile_budget.compile_own_code)
    if args.threads:
        torch.set_num_threads(args.threads)

    torch.manual_seed(0)
    B, Hq, H, D, S = args.batch, args.q_heads, args.kv_heads, args.head_dim, args.context
    cfg = KIVIConfig(args.bits, args.bits, args.group_size, args.residual_length)
    scale = 1.0 / math.sqrt(D)

    # Cache state: S - 1 tokens, then one appended token -> decode at context S.
    keys, values = torch.randn(B, H, S, D), torch.randn(B, H, S, D)
    cache = KIVICache(cfg, num_layers=1, batch_size=B, max_seq_len=S, num_kv_heads=H, head_dim=D)
    cache.layers[0].append(keys[:, :, : S - 1], values[:, :, : S - 1])
    layer, c = cache.layers[0].tensors(), cache.layers[0].params
    bufs, lengths = layer.kivi, layer.lengths
    k_new, v_new = keys[:, :, S - 1 :], values[:, :, S - 1 :]
    k_fp, v_fp = keys.clone(), values.clone()
    fp_lengths = torch.full((B,), S - 1)

    # ---- appends (one token; lengths reset each call so every call appends the same position)
    append_dec = torch.compile(append_decomposed, fullgraph=True)
    fp_append_c = torch.compile(fp_append, fullgraph=True)

    def run_op_append():
        lengths.fill_(S - 1)
        torch.ops.kivi.cache_append(*layer, k_new, v_new, None, *c)

    def run_dec_append():
        lengths.fill_(S - 1)
        append_dec(layer, k_new, v_new, None, c)

    def run_fp_append():
        fp_lengths.fill_(S - 1)
        fp_append_c(k_fp, v_fp, fp_lengths, k_new, v_new)

    # Sanity: from the same state, the decomposed append writes what the op writes (bit for bit).
    state = [b.clone() for b in bufs]
    run_op_append()
    want = [b.clone() for b in bufs]
    for b, s0 in zip(bufs, state):
        b.copy_(s0)
    run_dec_append()
    assert all(torch.equal(a, b) for a, b in zip(want, bufs)), "decomposed append differs from the op"
    for b, s0 in zip(bufs, state):
        b.copy_(s0)

    append_times = interleaved_times(
        {"kivi_op_append": run_op_append, "decomposed_append_compiled": run_dec_append,
         "fp32_index_put_append_compiled": run_fp_append}, "cpu", args.repeats)
    lengths.fill_(S)
    fp_lengths.fill_(S)

    # ---- attention at context S
    query = torch.randn(B, Hq, 1, D)
    sdpa_c = torch.compile(sdpa_decode, fullgraph=True)
    fused_c = torch.compile(lambda q: attend_fused(q, layer, None, c, scale), fullgraph=True)
    matmul_c = torch.compile(lambda q: attend_materialized(q, layer, None, c, scale), fullgraph=True)
    fns = {
        "sdpa_fp32_compiled": lambda: sdpa_c(query, k_fp, v_fp, fp_lengths, scale),
        "kivi_op": lambda: torch.ops.kivi.cache_attend(query, *layer, None, *c, scale),
        "decomposed_fused_compiled": lambda: fused_c(query),
        "decomposed_matmul_compiled": lambda: matmul_c(query),
    }
    ref = fns["kivi_op"]()
    max_abs_diff = {}
    for name in ("decomposed_fused_compiled", "decomposed_matmul_compiled"):
        max_abs_diff[name] = (fns[name]() - ref).abs().max().item()
        assert max_abs_diff[name] < 1e-4, f"{name} differs from the op by {max_abs_diff[name]}"
    attend_times = interleaved_times(fns, "cpu", args.repeats)

    def summarize(times, base):
        rows = {}
        for name, ts in times.items():
            ratios = [b / t for b, t in zip(times[base], ts)]
            rows[name] = dict(median_ms=1e3 * statistics.median(ts), min_ms=1e3 * min(ts),
                              speedup_vs_base=statistics.median(times[base]) / statistics.median(ts),
                              median_round_speedup_vs_base=statistics.median(ratios))
        return rows

    result = dict(
        shape=dict(batch=B, q_heads=Hq, kv_heads=H, head_dim=D, context=S, dtype="float32"),
        kivi=cfg.to_dict(),
        attend=dict(base="sdpa_fp32_compiled", rows=summarize(attend_times, "sdpa_fp32_compiled"),
                    max_abs_diff_vs_kivi_op=max_abs_diff),
        append=dict(base="fp32_index_put_append_compiled", rows=summarize(append_times, "fp32_index_put_append_compiled")),
        bytes=dict(fp32_kv=2 * k_fp.numel() * 4, kivi_layer=cache.nbytes()),
        repeats=args.repeats,
        inductor_byte_loads="aten (fill, copy, reload)" if args.aten_byte_loads else "one 8-byte load (avx2_byte_loads.py)",
        environment=environment(command="python -m lab decomposed_attend_cpu " + " ".join(argv or [])),
    )
    for part in ("attend", "append"):
        base = result[part]["base"]
        print(f"{part} (context {S}, B={B}, Hq={Hq}, Hkv={H}, D={D}; speedup = {base} time / time):")
        for name, row in result[part]["rows"].items():
            print(f"  {name:32s} median {row['median_ms']:8.3f} ms   min {row['min_ms']:8.3f} ms   "
                  f"speedup {row['speedup_vs_base']:6.2f}x (per-round median {row['median_round_speedup_vs_base']:.2f}x)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return result
