"""Per-layer decode costs on CUDA, replayed from CUDA graphs: the KIVI cache's append + attend vs the
fp static cache's append + SDPA, one token per sequence (what each decoder layer adds to a decode
step). Usage: python benchmarks/gpu_layer_costs.py [batch] [contexts, comma-separated]"""

import sys

import torch
from triton.testing import do_bench_cudagraph

from kivi_models.fp_cache import FPCache
from kivi_ops import KIVICache, KIVIConfig


# The caches' eager capacity checks read lengths on the host, which a CUDA-graph capture forbids;
# compiled decode skips them the same way (the kernels bound every write).
torch.compiler.is_compiling = lambda: True


def median_us(fn) -> float:
    return do_bench_cudagraph(fn, rep=100, return_mode="median") * 1e3


def main() -> None:
    batch = int(sys.argv[1]) if len(sys.argv) > 1 else 1
    contexts = [int(x) for x in (sys.argv[2] if len(sys.argv) > 2 else "1024,32768").split(",")]
    H, D, dt = 32, 128, torch.float16
    print(f"{torch.cuda.get_device_name()}, batch {batch}, 32 heads x 128, fp16; microseconds per layer (median)")
    print("context   cache    append   attend   append+attend")
    for n in contexts:
        k = torch.randn(batch, H, n, D, device="cuda", dtype=dt)
        q = torch.randn(batch, H, 1, D, device="cuda", dtype=dt)
        k1 = torch.randn(batch, H, 1, D, device="cuda", dtype=dt)
        for name in ("fp", "kivi-2"):
            dims = dict(num_layers=1, batch_size=batch, max_seq_len=n + 4096, num_kv_heads=H, head_dim=D, dtype=dt,
                        device="cuda")
            cache = FPCache(**dims) if name == "fp" else KIVICache(KIVIConfig(2, 2, 32, 128), **dims)
            cache.append(0, k, torch.randn_like(k))
            lengths = cache.lengths(0)
            # Each replay appends one token: reset the length so the cache never fills up. Capacity is context + 4096: the fp cache attends over its whole static buffer (masked), so its attend time here is that of context + 4096 tokens.
            start = lengths.clone()

            def append():
                lengths.copy_(start)
                cache.append(0, k1, k1)

            reset = median_us(lambda: lengths.copy_(start))
            a = median_us(append) - reset
            t = median_us(lambda: cache.attend(0, q))
            print(f"{n:>7} {name:>8} {a:>9.1f} {t:>8.1f} {a + t:>15.1f}")


if __name__ == "__main__":
    main()
