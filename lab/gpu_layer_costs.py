"""Per-layer decode costs on CUDA, replayed from CUDA graphs: the KIVI cache's append + attend vs the
fp static cache's append + SDPA, one token per sequence (what each decoder layer adds to a decode
step), and KIVI with the sparse store and with a sink/OTT pool (their appends are Triton kernels
too: what an option costs per step).

    python -m lab gpu_layer_costs [batch] [contexts, comma-separated]
"""

import argparse

import torch
from triton.testing import do_bench_cudagraph

from kivi_ops import FPCache, KIVICache, KIVIConfig


# The caches' eager capacity checks read lengths on the host, which a CUDA-graph capture forbids;
# compiled decode skips them the same way (the kernels bound every write).
torch.compiler.is_compiling = lambda: True


def median_us(fn) -> float:
    return do_bench_cudagraph(fn, rep=100, return_mode="median") * 1e3


CACHES = {  # name -> KIVIConfig (None: the fp static cache)
    "fp": None,
    "kivi-2": KIVIConfig(2, 2, 32, 128),
    "kivi-2 sparse 1%": KIVIConfig(2, 2, 32, 128, sparse_outliers=0.01),
    "kivi-2 sink 1+OTT 8": KIVIConfig(2, 2, 32, 128, sink_tokens=1, outlier_tokens=8, outlier_skip_layers=0),
}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m lab gpu_layer_costs", description=__doc__.split("\n\n")[0])
    parser.add_argument("batch", nargs="?", type=int, default=1)
    parser.add_argument("contexts", nargs="?", default="1024,32768")
    args = parser.parse_args(argv)
    batch, contexts = args.batch, [int(x) for x in args.contexts.split(",")]
    H, D, dt = 32, 128, torch.float16
    print(f"{torch.cuda.get_device_name()}, batch {batch}, 32 heads x 128, fp16; microseconds per layer (median)")
    print("append: a step that completes no key window; flush: one that completes one (every R = 128 steps)")
    print(f"{'context':>7} {'cache':>20} {'append':>8} {'flush':>8} {'attend':>8} {'append+attend':>14}")
    for n in contexts:
        k = torch.randn(batch, H, n, D, device="cuda", dtype=dt)
        q = torch.randn(batch, H, 1, D, device="cuda", dtype=dt)
        k1 = torch.randn(batch, H, 1, D, device="cuda", dtype=dt)
        for name, config in CACHES.items():
            dims = dict(num_layers=1, batch_size=batch, max_seq_len=n + 4096, num_kv_heads=H, head_dim=D, dtype=dt,
                        device="cuda")
            cache = FPCache(**dims) if config is None else KIVICache(config, **dims)
            cache.layers[0].append(k, torch.randn_like(k))
            lengths = cache.lengths(0)
            # Each replay appends one token from a fixed length, so the cache never fills up (the
            # fp cache attends over its whole static buffer, masked: context + 4096 slots).
            # From n - 1 stored tokens (n a multiple of R) the token completes a key window.
            times = {}
            for label, stored in (("append", n), ("flush", n - 1)):
                start = torch.full_like(lengths, stored)

                def append():
                    lengths.copy_(start)
                    cache.layers[0].append(k1, k1)

                times[label] = median_us(append) - median_us(lambda: lengths.copy_(start))
            lengths.fill_(n)
            t = median_us(lambda: cache.layers[0].attend(q))
            print(f"{n:>7} {name:>20} {times['append']:>8.1f} {times['flush']:>8.1f} {t:>8.1f} "
                  f"{times['append'] + t:>14.1f}")
