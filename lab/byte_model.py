"""Per-kernel byte model of the Triton decode path, without a GPU: bytes each kernel must read
for one decode step against the bytes it actually loads.

"Must read" is the cache state one decode step needs (per kv head: the packed codes of the
quantized tokens, their scales and zeros, the fp16 residual tokens), plus the query and the
lengths; for the append, the new key and value, the value leaving the window and, on the one
step in R that completes a key window, that window. "Loaded" is counted by running the kernels in
Triton's CPU interpreter (TRITON_INTERPRET=1) with every load instrumented: `loaded` counts each
unmasked element of each load (what the kernel asks of the memory system), `distinct` counts
each address once (what DRAM must deliver if every re-read hits L2). loaded / must > 1 shows
redundant reads (GQA query heads re-reading their kv head's codes, a split's scale rows);
distinct / must < 1 would mean the kernel skipped data it needs.

    .venv/bin/python -m lab byte_model [--tokens 4096] [--json out.json]

Interpreting is slow, so the shapes are small (batch 1, 4096 tokens, 4 or 2 kv heads); the
ratios are per token and per head, so they carry to the benchmark shapes.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import numpy as np  # noqa: E402
import torch  # noqa: E402

from kivi_benchmarks.environment import environment  # noqa: E402


@contextlib.contextmanager
def counting_loads():
    """Within: {kernel name: {"loaded": bytes of unmasked lanes, "bytes_per_address": {address:
    element size}}} of every launch."""
    from triton.runtime import interpreter

    counts: dict[str, dict] = {}
    current = [None]
    builder = interpreter.InterpreterBuilder
    saved_load, saved_wrap = builder.create_masked_load, torch.library.wrap_triton

    def load(self, ptrs, mask, other, *args):
        rec = counts.setdefault(current[0], dict(loaded=0, bytes_per_address={}))
        size = np.dtype(interpreter._get_np_dtype(ptrs.get_element_ty())).itemsize
        addresses = ptrs.data[np.broadcast_to(mask.data, ptrs.data.shape)]
        rec["loaded"] += int(addresses.size) * size
        for a in np.unique(addresses).tolist():
            rec["bytes_per_address"][a] = size
        return saved_load(self, ptrs, mask, other, *args)

    def launcher(fn):
        class Launch:
            def __getitem__(self, grid):
                def run(*args, **kwargs):
                    current[0] = fn.fn.__name__
                    return fn[grid](*args, **kwargs)
                return run
        return Launch()

    builder.create_masked_load = load
    torch.library.wrap_triton = launcher
    try:
        yield counts
    finally:
        builder.create_masked_load, torch.library.wrap_triton = saved_load, saved_wrap


def must_read_attend(L: int, B: int, Hq: int, H: int, D: int, bits: int, G: int, R: int, elt: int = 2) -> int:
    """Bytes one decode step must read at context L (module doc): per kv head, codes + per-group
    key scale/zero + per-token value scale/zero of the quantized tokens, fp residual tokens."""
    nqk = L // R * R
    nqv = max(L - R, 0)
    gv = min(G, D)
    keys = nqk * D * bits // 8 + (nqk // G) * D * 2 * elt + (L - nqk) * D * elt
    values = nqv * D * bits // 8 + nqv * (D // gv) * 2 * elt + (L - nqv) * D * elt
    return B * H * (keys + values) + B * Hq * D * elt + B * 8


def must_read_append(B: int, H: int, D: int, R: int, flush: bool, elt: int = 2) -> int:
    """Bytes one decode-step append must read: the new key and value, the value leaving the
    window, and the key window it completes (R - 1 residual keys) when it flushes; lengths."""
    per_head = 2 * D * elt + D * elt + ((R - 1) * D * elt if flush else 0)
    return B * H * per_head + B * 8


def _rows(shape: dict, step: str, context: int, must: int, counts: dict) -> list[dict]:
    """One row per kernel of a counting_loads record."""
    rows = []
    for kernel, rec in counts.items():
        distinct = sum(rec["bytes_per_address"].values())
        rows.append(dict(**shape, step=step, context=context, kernel=kernel, must_read_bytes=must,
                         loaded_bytes=rec["loaded"], distinct_bytes=distinct, loaded_over_must=rec["loaded"] / must,
                         distinct_over_must=distinct / must))
    return rows


def measure(tokens: int) -> list[dict]:
    from kivi_ops import KIVICache, KIVIConfig
    from kivi_ops.kernels.triton.append import append_triton
    from kivi_ops.kernels.triton.decode import attend_decode

    G, R, B, rows = 32, 128, 1, []
    for Hq, H, D in ((4, 4, 128), (8, 2, 64)):
        for bits in (2, 4):
            shape = dict(batch=B, q_heads=Hq, kv_heads=H, head_dim=D, bits=bits, group_size=G, residual_length=R)
            cache = KIVICache(KIVIConfig(bits, bits, G, R), num_layers=1, batch_size=B, max_seq_len=tokens + R,
                              num_kv_heads=H, head_dim=D, dtype=torch.float16)
            gen = torch.Generator().manual_seed(0)
            kv = torch.randn(2, B, H, tokens - 2, D, generator=gen).half()
            cache.layers[0].append(kv[0], kv[1])  # the CPU reference; the append below completes no window
            layer, params = cache.layers[0].tensors(), cache.layers[0].params
            new = torch.randn(2, B, H, 1, D, generator=gen).half()
            q = torch.randn(B, Hq, 1, D, generator=gen).half()
            steps = {"append (no flush)": lambda: append_triton(layer, new[0], new[1], None, params),
                     "attend": lambda: attend_decode(q, layer, None, params, D ** -0.5)}
            for what, run in steps.items():
                with counting_loads() as counts:
                    run()
                L = int(layer.lengths[0])
                must = (must_read_append(B, H, D, R, flush=False) if what.startswith("append")
                        else must_read_attend(L, B, Hq, H, D, bits, G, R))
                rows += _rows(shape, what, L, must, counts)
            # The step that completes a key window: lengths to R * k - 1, then one token.
            layer.lengths.fill_((tokens // R) * R + R - 1)
            with counting_loads() as counts:
                append_triton(layer, new[0], new[1], None, params)
            rows += _rows(shape, "append (key flush)", int(layer.lengths[0]), must_read_append(B, H, D, R, flush=True),
                          counts)
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m lab byte_model", description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--json", default=None, help="write the rows here")
    args = parser.parse_args(argv)
    if args.tokens < 2:
        parser.error(f"--tokens must be at least 2 (a cache, then one appended token), got {args.tokens}")
    rows = measure(args.tokens)
    print(f"{'shape':<22} {'step':<20} {'kernel':<24} {'must':>9} {'loaded':>9} {'distinct':>9} {'ld/must':>7} "
          f"{'dist/must':>9}")
    for r in rows:
        shape = f"Hq={r['q_heads']} Hkv={r['kv_heads']} D={r['head_dim']} b{r['bits']}"
        print(f"{shape:<22} {r['step']:<20} {r['kernel']:<24} {r['must_read_bytes']:>9} {r['loaded_bytes']:>9} "
              f"{r['distinct_bytes']:>9} {r['loaded_over_must']:>7.2f} {r['distinct_over_must']:>9.2f}")
    if args.json:
        meta = dict(**environment(command=f"python -m lab byte_model --tokens {args.tokens}"), tokens=args.tokens,
                    note="loads counted in Triton's interpreter: element bytes of unmasked lanes (loaded) and of "
                         "distinct addresses (distinct); fp16 cache, G=32, R=128, batch 1")
        with open(args.json, "w") as f:
            json.dump(dict(meta=meta, rows=rows), f, indent=1)
            f.write("\n")
