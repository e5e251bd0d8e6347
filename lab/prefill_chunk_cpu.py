"""On CPU: what prefilling a prompt in chunks (`kivi serve --prefix-caching`,
models/generate.prefill_chunked) costs against a one-shot prefill, per chunk size.

The default model (SmolLM2-135M, fp32), one prompt of `--prompt` tokens in a batch-1 paged cache
of `--capacity` tokens (the server's staging cache), paged KIVI-2 (G 32, R 128, 32-token pages)
and paged fp (16-token pages); one-shot (`prefill`: exact attention) and chunks of 32, 64, 128 and
256 tokens (each appended, then attending through the cache). Best of `--repeats` wall-clock runs.

    .venv/bin/python -m lab prefill_chunk_cpu [--threads 1] [--prompt 512] [--capacity 2048]
"""

from __future__ import annotations

import argparse
import time

import torch


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lab prefill_chunk_cpu", description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--capacity", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    from kivi_models import patch_model
    from kivi_models.generate import make_paged_cache, prefill, prefill_chunked
    from kivi_models.loading import load_model
    from kivi_ops import KIVIConfig

    model, _ = load_model(dtype=torch.float32, device="cpu")
    patch_model(model)
    ids = list(range(1000, 1000 + args.prompt))  # token values do not change the cost
    for method in ("kivi", "fp"):
        cache = make_paged_cache(model, method=method, batch_size=1, max_seq_len=args.capacity,
                                 num_pages=args.capacity // 16, kivi_config=KIVIConfig())
        table = torch.arange(cache.max_pages_per_seq, dtype=torch.int32)[None]
        for chunk in (None, 32, 64, 128, 256):
            if chunk is not None and chunk % cache.page_size:
                continue
            times = []
            for _ in range(args.repeats):
                cache.reset()
                cache.block_table.copy_(table)
                start = time.perf_counter()
                with torch.inference_mode():
                    if chunk is None:
                        prefill(model, cache, torch.tensor([ids]), torch.tensor([len(ids)]))
                    else:
                        prefill_chunked(model, cache, ids, chunk)
                times.append(time.perf_counter() - start)
            print(f"{method:5} page {cache.page_size:3}  {'one-shot' if chunk is None else f'chunk {chunk}':>9}  "
                  f"{min(times):.3f} s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
