"""CPU: the compiled decode step of `kivi serve --paged` over every row against the step over the
decode bucket that holds the requests (kivi_ops/cache/row_view.py), same run, interleaved.

    OMP_NUM_THREADS=1 .venv/bin/python -m lab decode_buckets_cpu [--rows 94] [--active 24]
        [--bucket 32] [--context 160] [--steps 12] [--out FILE]

The embedded model (SmolLM2-135M, fp32), a paged KIVI-2 cache (G=32, R=32, 32-token pages) of
`rows` rows, `active` requests prefilled into the lowest rows with prompts of about `context`
tokens (the other rows idle, as in a server between bursts). Two runners over the same state take
the same greedy steps: one runs every row, one the first `bucket` rows. Checked: the same greedy
tokens at every step. Reported: the median step time of each and their ratio.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import time

import torch


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=94)
    ap.add_argument("--active", type=int, default=24)
    ap.add_argument("--bucket", type=int, default=32)
    ap.add_argument("--context", type=int, default=160)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--max-seq-len", type=int, default=2048)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if not args.active <= args.bucket <= args.rows:
        ap.error("need active <= bucket <= rows")

    import transformers

    from kivi_models import load_model, patch_model
    from kivi_models.corpus import load_text
    from kivi_serve.paged_options import PagedServing
    from kivi_serve.runner import Runner
    from kivi_ops import KIVIConfig

    model, tokenizer = load_model(dtype=torch.float32, device="cpu")
    model = patch_model(model)
    config = KIVIConfig(k_bits=2, v_bits=2, group_size=32, residual_length=32)
    ids = tokenizer(load_text(text_file=None, corpus="pydoc")[:200_000])["input_ids"]
    prompts = [ids[i * 997:i * 997 + args.context - (i * 13) % 48] for i in range(args.active)]
    need = args.context + args.steps + 2
    runners = {}
    for name in ("all rows", "bucket"):
        runner = Runner(model, method="kivi", kivi_config=config, slots=args.rows, max_seq_len=args.max_seq_len,
                        paging=PagedServing(num_pages=args.active * (need // 32 + 2)), compile=True)
        per_row = runner.cache.pages_needed(need)
        table = torch.full_like(runner.cache.block_table, runner.cache.num_pages, device="cpu")
        for row in range(args.active):
            table[row, :per_row] = torch.arange(row * per_row, (row + 1) * per_row)
        runner.write_table(table)
        runners[name] = runner
    rows_of = {"all rows": args.rows, "bucket": args.bucket}
    times = {name: [] for name in runners}
    compile_s = {}
    with torch.inference_mode():
        tokens = {}
        for name, runner in runners.items():
            tokens[name] = [int(runner.prefill(row, p, list(range(row * per_row, row * per_row + runner.cache.pages_needed(len(p)))))
                                .argmax()) for row, p in enumerate(prompts)]
        assert tokens["all rows"] == tokens["bucket"]
        for step in range(args.steps + 1):
            for name, runner in runners.items():
                batch = tokens[name] + [-1] * (rows_of[name] - args.active)
                t0 = time.perf_counter()
                logits = runner.decode(batch)
                dt = time.perf_counter() - t0
                (times[name] if step else compile_s.setdefault(name, [])).append(dt)
                tokens[name] = logits[:args.active].argmax(dim=-1).tolist()
            assert tokens["all rows"] == tokens["bucket"], f"step {step}: the greedy tokens differ"
    med = {name: statistics.median(ts) for name, ts in times.items()}
    result = dict(rows=args.rows, active=args.active, bucket=args.bucket, context=args.context, steps=args.steps,
                  median_step_s=med, first_step_s={k: v[0] for k, v in compile_s.items()},
                  bucket_over_all_rows=med["bucket"] / med["all rows"],
                  per_active_row_ms={k: 1e3 * v / args.active for k, v in med.items()},
                  device=platform.processor() or platform.machine(), threads=torch.get_num_threads(),
                  torch=torch.__version__, transformers=transformers.__version__, python=platform.python_version(),
                  greedy_tokens_equal=True, command="OMP_NUM_THREADS=1 python -m lab decode_buckets_cpu "
                  + " ".join(argv if argv is not None else __import__("sys").argv[1:]),
                  commit=subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                        text=True).stdout.strip() or None)
    print(json.dumps(result, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
