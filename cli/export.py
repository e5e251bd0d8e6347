"""`kivi export` and `kivi run-exported`."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

from kivi_export.artifact import FORMATS, ArtifactError

from .args import (add_model_arguments, add_prompt_arguments, add_sampling_arguments, device_and_dtype,
                   dumps_json, encode, generation_report, kivi_config_from, positive_int,
                   print_generations, read_prompts, usage_errors)


def add_export_parsers(sub) -> None:
    e = sub.add_parser("export", help="export the KIVI decoder (model + static cache) for deployment")
    e.add_argument("--format", required=True, choices=FORMATS,
                   help="pt2: torch.export program; aoti: AOTInductor package; onnx: ONNX for onnxruntime; "
                        "pte: ExecuTorch program")
    e.add_argument("--out", required=True, help="directory to write (must not exist or be empty, see --overwrite)")
    add_model_arguments(e)
    e.add_argument("--batch-size", type=positive_int, default=1, help="sequences per call (static)")
    e.add_argument("--max-seq-len", type=positive_int, default=1024, help="cache capacity: prompt + new tokens")
    e.add_argument("--overwrite", action="store_true", help="replace an earlier KIVI export at --out (its own files only: any other file there makes the export refuse, naming it)")
    e.set_defaults(func=cmd_export, parser=e)

    r = sub.add_parser("run-exported", help="generate with an exported decoder (no model is built in Python)")
    r.add_argument("path", help="a directory written by `kivi export`")
    add_prompt_arguments(r, batch_help="a file with one prompt per line (as many as the export's batch size)")
    add_sampling_arguments(r)
    r.set_defaults(func=cmd_run_exported, parser=r)


def cmd_export(args, parser) -> int:
    from kivi_export.exporter import check_target

    kivi_config = kivi_config_from(args, parser)
    device, dtype = device_and_dtype(args, parser)
    if torch.device(device).type != "cpu":
        # Measured on an H200 (torch 2.11, 2026-11-26): a CUDA AOTInductor package exported, then
        # crashed the process (segfault) in aoti_load_package; and run-exported feeds CPU tensors.
        parser.error(f"--device {device}: exports are built for the CPU (kivi run-exported runs them there); a CUDA "
                     "AOTInductor package crashed when loaded on a GPU, so CUDA exports are refused until that is "
                     "fixed (docs/deploy.md)")
    with usage_errors(parser, FileExistsError, ValueError):
        check_target(Path(args.out), args.overwrite)  # before the minutes of loading and tracing (checked again under the lock)
    try:
        meta = _load_and_export(args, parser, kivi_config, device, dtype)
    except KeyboardInterrupt:  # the export is staged beside --out: nothing there changed
        print(f"{parser.prog}: interrupted; --out {args.out} was left as it was", file=sys.stderr)
        return 130
    print(dumps_json({"out": str(args.out), "format": meta.format, "program": meta.program,
                      "sha256": meta.sha256, "digest": meta.digest, "config": meta.config_summary()}))
    return 0


def _load_and_export(args, parser, kivi_config, device, dtype):
    from kivi_models.attention import patch_model
    from kivi_models.loading import load_model
    from kivi_models.weight_quant import apply_weight_quant, check_weight_quant

    from kivi_export.exporter import export_decoder

    with usage_errors(parser, FileNotFoundError, ValueError):
        check_weight_quant(args.weight_quant, device)
        model, tokenizer = load_model(args.model, dtype=dtype, device=device)
    apply_weight_quant(model, args.weight_quant)
    patch_model(model)
    with usage_errors(parser, FileExistsError, ValueError):
        return export_decoder(model, tokenizer, Path(args.out), fmt=args.format, model_name=args.model,
                              method=args.method, kivi_config=kivi_config, batch_size=args.batch_size,
                              max_seq_len=args.max_seq_len, weight_quant=args.weight_quant, overwrite=args.overwrite)


def cmd_run_exported(args, parser) -> int:
    from kivi_models.generate import SamplingConfig, check_generation_args, generation_loop

    from kivi_export.runtime import load_exported

    sampling = SamplingConfig(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    prompts = read_prompts(args, parser)
    start = time.perf_counter()
    try:
        meta, tokenizer, step = load_exported(Path(args.path))
    except ArtifactError as e:
        print(f"kivi run-exported: error: {e}", file=sys.stderr)
        return 1
    load_s = time.perf_counter() - start
    ids = [encode(tokenizer, p, args.chat) for p in prompts]
    if len(ids) != meta.batch_size:
        parser.error(f"{len(ids)} prompt(s), but {args.path} was exported for --batch-size {meta.batch_size}")
    try:
        check_generation_args(ids, args.max_new_tokens, batch_size=meta.batch_size, max_seq_len=meta.max_seq_len)
    except ValueError as e:
        parser.error(f"{e} (re-export with a larger --max-seq-len)")
    result = generation_loop(
        lambda input_ids, counts: step(input_ids, torch.zeros_like(counts), counts),  # position 0: new sequences
        lambda tokens, positions: step(tokens[:, None], positions, torch.ones_like(positions)),
        ids, max_new_tokens=args.max_new_tokens, device="cpu", sampling=sampling,
        eos_token_id=meta.eos_token_id, pad_token_id=meta.pad_token_id, seed=args.seed,
    )
    texts, report = generation_report(tokenizer, result)
    report.update({
        "compile_s": 0.0,
        "load_s": load_s,
        "cache_bytes": meta.cache_bytes,
        "fp16_cache_bytes": meta.fp16_cache_bytes,
        "wall_s": time.perf_counter() - start,
        "config": {**meta.config_summary(), "format": meta.format, "exported": str(args.path),
                   "max_new_tokens": args.max_new_tokens, "sampling": vars(sampling)},
    })
    if args.json:
        print(dumps_json(report))
        return 0
    print_generations(prompts, texts, args.chat)
    print(f"\n{meta.format} program loaded in {load_s:.1f} s; prefill {result.prefill_tokens_per_s:.1f} tokens/s, "
          f"decode {result.decode_tokens_per_s:.1f} tokens/s")
    return 0

