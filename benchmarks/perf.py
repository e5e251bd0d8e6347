"""`kivi bench memory | attention | decode`: cache bytes, fused attention speed, end-to-end decode speed.

Every ratio is measured side by side in one run. GPU timings use triton.testing.do_bench (warm-up,
median over many repeats); CPU timings take the median of repeated wall-clock runs. Inputs are
random, never zeros. Results carry the device, versions, git sha and the exact command.
"""

from __future__ import annotations

import math
import platform
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F
from tqdm import tqdm

from kivi_ops import KIVICache, KIVIConfig, fp16_cache_nbytes

# Llama-2-7B's attention shape: 32 layers, 32 KV heads, head_dim 128.
LLAMA2_7B = dict(num_layers=32, num_kv_heads=32, head_dim=128)


def environment(device: str) -> dict:
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        sha = None
    env = dict(torch=torch.__version__, python=platform.python_version(), git_sha=sha,
               command=" ".join(["kivi", *sys.argv[1:]]), threads=torch.get_num_threads())
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    env["device"] = torch.cuda.get_device_name() if device == "cuda" else (platform.processor() or platform.machine())
    return env


# ---------------------------------------------------------------- memory


def theoretical_kivi_bytes(cfg: KIVIConfig, *, tokens: int, num_layers: int, num_kv_heads: int, head_dim: int,
                           scale_bytes: int = 2, batch_size: int = 1) -> int:
    """The paper's accounting: packed codes, a scale and zero per group, the fp residual window."""
    D, G = head_dim, cfg.group_size
    per_head = (tokens * D * (cfg.k_bits + cfg.v_bits) // 8          # codes
                + 2 * math.ceil(tokens / G) * D * scale_bytes          # key scale + zero per (G tokens, channel)
                + 2 * tokens * (D // min(G, D)) * scale_bytes          # value scale + zero per (token, G channels)
                + 2 * min(cfg.residual_length, tokens) * D * scale_bytes)  # key and value residual windows
    return num_layers * batch_size * (num_kv_heads * per_head + 8)     # + the int64 length per sequence


def bench_memory(contexts=(1024, 4096, 16384, 32768, 131072)) -> dict:
    rows = []
    for bits in (2, 4):
        for G in (32, 128):
            for R in (32, 128):
                if R % G:
                    continue  # keys flush whole groups: R must be a multiple of G (G=128, R=32 is invalid)
                cfg = KIVIConfig(bits, bits, G, R)
                for n in contexts:
                    cache = KIVICache(cfg, max_seq_len=n, batch_size=1, dtype=torch.float16, device="meta",
                                      **LLAMA2_7B)
                    fp16 = fp16_cache_nbytes(batch_size=1, num_tokens=n, **LLAMA2_7B)
                    rows.append(dict(bits=bits, group_size=G, residual_length=R, tokens=n,
                                     kivi_bytes=cache.nbytes(), theory_bytes=theoretical_kivi_bytes(cfg, tokens=n, **LLAMA2_7B),
                                     fp16_bytes=fp16, ratio=fp16 / cache.nbytes()))
    return dict(model_shape=LLAMA2_7B, scale_dtype="float16", rows=rows, environment=environment("cpu"))


# ---------------------------------------------------------------- attention


def _median_time(fn, device: str, repeats: int) -> float:
    """Median seconds of fn()."""
    if device == "cuda":
        from triton.testing import do_bench

        return do_bench(fn, warmup=25, rep=100, return_mode="median") / 1e3
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def copy_bandwidth(device: str, nbytes: int = 1 << 30) -> float:
    """Measured device-to-device copy bandwidth in bytes/s (read + write counted)."""
    src = torch.empty(nbytes // 2, dtype=torch.float16, device=device).uniform_()
    dst = torch.empty_like(src)
    t = _median_time(lambda: dst.copy_(src), device, 5)
    return 2 * src.numel() * src.element_size() / t


def attend_read_bytes(cache: KIVICache, tokens: int) -> int:
    """Bytes the fused op must read for one decode step at `tokens` context (all batch rows)."""
    c = cache.config
    one = KIVICache(c, num_layers=1, batch_size=cache.batch_size, max_seq_len=tokens,
                    num_kv_heads=cache.num_kv_heads, head_dim=cache.head_dim, dtype=cache.dtype, device="meta")
    return one.nbytes()


def bench_attention(device: str, contexts, bits_list=(2, 4), batch: int = 1, q_heads: int = 32, kv_heads: int = 32,
                    head_dim: int = 128, repeats: int = 20) -> dict:
    dtype = torch.float16 if device == "cuda" else torch.float32
    bandwidth = copy_bandwidth(device) if device == "cuda" else None
    rows = []
    for n in tqdm(contexts, desc="attention", leave=False):
        k = torch.randn(batch, kv_heads, n, head_dim, device=device, dtype=dtype)
        v = torch.randn_like(k)
        q = torch.randn(batch, q_heads, 1, head_dim, device=device, dtype=dtype)
        sdpa = _median_time(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True), device, repeats)
        for bits in bits_list:
            cache = KIVICache(KIVIConfig(bits, bits, 32, 128), num_layers=1, batch_size=batch, max_seq_len=n,
                              num_kv_heads=kv_heads, head_dim=head_dim, dtype=dtype, device=device)
            cache.append(0, k, v)
            t = _median_time(lambda: cache.attend(0, q), device, repeats)
            row = dict(tokens=n, bits=bits, batch=batch, q_heads=q_heads, kv_heads=kv_heads, head_dim=head_dim,
                       sdpa_s=sdpa, kivi_s=t, speedup=sdpa / t)
            if bandwidth:
                read = attend_read_bytes(cache, n)
                row.update(read_bytes=read, achieved_bytes_per_s=read / t, copy_bandwidth=bandwidth,
                           bandwidth_share=read / t / (bandwidth / 2))  # copy reads half its bytes
            rows.append(row)
            del cache
        del k, v
    return dict(device=device, dtype=str(dtype), rows=rows, environment=environment(device))


# ---------------------------------------------------------------- decode


def bench_decode(model, *, device: str, contexts, batches, new_tokens: int = 32, kivi_config=None) -> dict:
    """Compiled decode tokens/s, fp vs KIVI, same model, same run (CUDA graphs on GPU)."""
    from kivi_models import compile_decode_step, generate, make_cache

    kivi_config = kivi_config or KIVIConfig()
    rows = []
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    for batch in batches:
        for n in contexts:
            prompts = torch.randint(3, vocab, (batch, n), generator=gen).tolist()
            row = dict(batch=batch, context=n, new_tokens=new_tokens)
            for method in ("fp", "kivi"):
                cache = make_cache(model, method=method, batch_size=batch, max_seq_len=n + new_tokens,
                                   kivi_config=kivi_config)
                if device == "cuda":
                    torch.cuda.reset_peak_memory_stats()
                r = generate(model, prompts, max_new_tokens=new_tokens, cache=cache,
                             step_fn=compile_decode_step(torch.device(device)), warmup_steps=3)
                row[f"{method}_tokens_per_s"] = r.decode_tokens_per_s
                row[f"{method}_cache_bytes"] = cache.nbytes()
                if device == "cuda":
                    row[f"{method}_peak_bytes"] = torch.cuda.max_memory_allocated()
                del cache
            row["speedup"] = row["kivi_tokens_per_s"] / row["fp_tokens_per_s"]
            print(f"  batch {batch} context {n}: fp {row['fp_tokens_per_s']:.1f} tok/s, "
                  f"KIVI {row['kivi_tokens_per_s']:.1f} tok/s ({row['speedup']:.2f}x)", file=sys.stderr, flush=True)
            rows.append(row)
    return dict(device=device, kivi=kivi_config.to_dict(), rows=rows, environment=environment(device))
