"""The `kivi` command line. `kivi generate`: text generation with a KIVI (or fp) static cache."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from kivi_ops import KIVIConfig
from kivi_ops.config import SUPPORTED_BITS, SUPPORTED_GROUP_SIZES

from .generate import METHODS, SamplingConfig, compile_decode_step, decode_step, generate, make_cache
from .loading import DEFAULT_MODEL, load_model, log

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def add_model_arguments(p: argparse.ArgumentParser, methods=METHODS) -> None:
    """Model, method and cache flags shared by the subcommands."""
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help="'default' (the embedded SmolLM2-135M-Instruct) or a local Hugging Face Llama-family directory")
    p.add_argument("--method", choices=methods, default="kivi", help="kivi: quantized cache; fp: unquantized static cache")
    p.add_argument("--k-bits", type=int, choices=SUPPORTED_BITS, default=2)
    p.add_argument("--v-bits", type=int, choices=SUPPORTED_BITS, default=2)
    p.add_argument("--group-size", type=int, choices=SUPPORTED_GROUP_SIZES, default=32)
    p.add_argument("--residual-length", type=int, default=128, help="full-precision recent tokens (multiple of --group-size)")
    p.add_argument("--sink-tokens", type=int, default=0,
                   help="keep the first N tokens of each sequence in full precision (KVQuant's attention sink)")
    p.add_argument("--outlier-tokens", type=int, default=0,
                   help="OTT: N full-precision outlier tokens per layer and kv head, chosen by smallest key magnitude "
                        "(the paper uses 3)")
    p.add_argument("--outlier-spill", type=int, default=32,
                   help="OTT: slots for tokens evicted from the outlier pool; when full, no new outliers")
    p.add_argument("--outlier-skip-layers", type=int, default=2, help="OTT: the first N layers get no outlier pool")
    p.add_argument("--pre-rope", action="store_true",
                   help="KVQuant: store keys before RoPE (quantized per channel there); attention rotates them")
    p.add_argument("--nuq", default=None, metavar="PATH",
                   help="KVQuant nuqX: per-layer non-uniform levels from `kivi calibrate` (same --group-size, "
                        "--pre-rope and --sparse-outliers as calibrated) instead of the uniform grid")
    p.add_argument("--sparse-outliers", type=fraction_arg, default=0.0, metavar="FRACTION",
                   help="KVQuant dense-and-sparse: keep this fraction of each key channel (per R-token window) and "
                        "of each value token exact, e.g. 0.01")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=tuple(DTYPES), default=None, help="default: float32 on cpu, float16 on cuda")
    from .weight_quant import WEIGHT_QUANT_MODES

    p.add_argument("--weight-quant", choices=WEIGHT_QUANT_MODES, default="none",
                   help="torchao weight-only quantization of the Linear layers: int8 (cpu, cuda) or int4 (cuda)")


def fraction_arg(text: str) -> float:
    from kivi_ops.dense_sparse import check_outlier_fraction

    try:
        value = float(text)
        check_outlier_fraction(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a fraction in [0, 0.5), e.g. 0.01, got {text!r}")
    return value


def _nuq_levels(args, parser) -> dict:
    """{"key_levels": ..., "value_levels": ...} for KIVIConfig from --nuq, checked against the model."""
    from kivi_ops.nuq import config_levels

    from .loading import resolve_model_path

    try:
        num_layers = json.loads((resolve_model_path(args.model) / "config.json").read_text())["num_hidden_layers"]
        return config_levels(args.nuq, k_bits=args.k_bits, v_bits=args.v_bits, num_layers=num_layers,
                             group_size=args.group_size, pre_rope=args.pre_rope, sparse_outliers=args.sparse_outliers)
    except (ValueError, OSError) as e:
        parser.error(str(e))


# CLI spelling of the KIVIConfig fields in error messages.
_FLAG_NAMES = (("sink_tokens", "--sink-tokens"), ("outlier_tokens", "--outlier-tokens"),
               ("outlier_spill", "--outlier-spill"), ("outlier_skip_layers", "--outlier-skip-layers"),
               ("sparse_outliers", "--sparse-outliers"))


def kivi_config_from(args, parser) -> KIVIConfig:
    """The KIVIConfig the flags describe. KVQuant's flags (--pre-rope, --nuq, --sparse-outliers)
    configure the cache for --method kivi; --method fake applies them itself (eval ppl)."""
    method = getattr(args, "method", "kivi")
    kvquant = dict(pre_rope=args.pre_rope, sparse_outliers=args.sparse_outliers)
    if method == "kivi" and args.nuq:
        kvquant.update(_nuq_levels(args, parser))
    try:
        config = KIVIConfig(k_bits=args.k_bits, v_bits=args.v_bits, group_size=args.group_size,
                            residual_length=args.residual_length, sink_tokens=args.sink_tokens,
                            outlier_tokens=args.outlier_tokens, outlier_spill=args.outlier_spill,
                            outlier_skip_layers=args.outlier_skip_layers, **(kvquant if method == "kivi" else {}))
    except ValueError as e:
        message = str(e)
        for field, flag in _FLAG_NAMES:
            message = message.replace(field, flag)
        parser.error(message)
    if method != "kivi" and config.has_pool:
        parser.error(f"--sink-tokens / --outlier-tokens are options of the KIVI cache (--method kivi), "
                     f"not of --method {method}")
    if method == "fp" and (args.pre_rope or args.nuq or args.sparse_outliers):
        parser.error("--pre-rope / --nuq / --sparse-outliers are options of the KIVI cache (--method kivi) "
                     "or of fake quantization (--method fake), not of --method fp")
    return config


def device_and_dtype(args, parser) -> tuple[str, torch.dtype]:
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda was requested but no CUDA device is available")
    dtype = DTYPES[args.dtype] if args.dtype else (torch.float16 if args.device == "cuda" else torch.float32)
    return args.device, dtype


def read_prompts(args, parser) -> list[str]:
    try:
        if args.prompt is not None:
            return [args.prompt]
        if args.prompt_file is not None:
            return [Path(args.prompt_file).read_text().rstrip("\n")]
        prompts = [line for line in Path(args.batch_file).read_text().splitlines() if line.strip()]
    except OSError as e:
        parser.error(f"cannot read prompt file: {e}")
    if not prompts:
        parser.error(f"--batch-file {args.batch_file} holds no prompts (one per line)")
    return prompts


def encode(tokenizer, prompt: str, chat: bool) -> list[int]:
    if chat:
        return tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                             tokenize=True, return_dict=False)
    return tokenizer(prompt)["input_ids"]


def cmd_generate(args, parser) -> int:
    kivi_config = kivi_config_from(args, parser)
    device, dtype = device_and_dtype(args, parser)
    sampling = SamplingConfig(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    prompts = read_prompts(args, parser)
    from .weight_quant import apply_weight_quant, check_weight_quant, model_weight_nbytes

    try:
        check_weight_quant(args.weight_quant, device)
    except ValueError as e:
        parser.error(str(e))
    try:
        model, tokenizer = load_model(args.model, dtype=dtype, device=device)
    except FileNotFoundError as e:
        print(f"kivi generate: error: {e}", file=sys.stderr)
        return 1
    from .attention import patch_model

    try:
        apply_weight_quant(model, args.weight_quant)
    except ValueError as e:
        parser.error(str(e))
    model_bytes = model_weight_nbytes(model)
    patch_model(model)
    ids = [encode(tokenizer, p, args.chat) for p in prompts]
    max_seq_len = max(len(i) for i in ids) + args.max_new_tokens
    cache = make_cache(model, method=args.method, batch_size=len(ids), max_seq_len=max_seq_len, kivi_config=kivi_config)
    step_fn, warmup = decode_step, 0
    if args.compile:
        how = ", CUDA graphs" if device == "cuda" else ", KIVI ops decomposed for Inductor" if args.method == "kivi" else ""
        log(f"Compiling the decode step (torch.compile fullgraph{how}); the first steps are not timed...")
        step_fn, warmup = compile_decode_step(torch.device(device)), 2
    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    start = time.perf_counter()
    result = generate(model, ids, max_new_tokens=args.max_new_tokens, cache=cache, sampling=sampling,
                      eos_token_id=eos, pad_token_id=pad, step_fn=step_fn, warmup_steps=warmup, seed=args.seed)
    if args.compile:
        log(f"Compiled and warmed up in {result.compile_s:.1f} s")
    texts = [tokenizer.decode(t, skip_special_tokens=True) for t in result.tokens]
    batched = len(ids) > 1
    config = {"model": args.model, "method": args.method, "device": device, "dtype": str(dtype).replace("torch.", ""),
              "compile": args.compile, "weight_quant": args.weight_quant, "batch_size": len(ids),
              "max_new_tokens": args.max_new_tokens,
              "sampling": vars(sampling), **({"kivi": kivi_config.to_record(args.nuq)} if args.method == "kivi" else {})}
    report = {
        "text": texts if batched else texts[0],
        "tokens": result.tokens if batched else result.tokens[0],
        "prompt_tokens": result.prompt_tokens if batched else result.prompt_tokens[0],
        "new_tokens": [len(t) for t in result.tokens] if batched else len(result.tokens[0]),
        "prefill_tokens_per_s": result.prefill_tokens_per_s,
        "decode_tokens_per_s": result.decode_tokens_per_s,
        "compile_s": result.compile_s,
        "cache_bytes": result.cache_bytes,
        "fp16_cache_bytes": result.fp16_cache_bytes,
        "model_bytes": model_bytes,
        "wall_s": time.perf_counter() - start,
        "config": config,
    }
    if args.json:
        print(json.dumps(report))
        return 0
    for prompt, text in zip(prompts, texts):
        print(f"{prompt}{text}" if not args.chat else text)
        if batched:
            print("-" * 40)
    ratio = result.fp16_cache_bytes / result.cache_bytes
    print(f"\nprefill: {result.prefill_tokens_per_s:.1f} tokens/s ({sum(result.prompt_tokens)} tokens)")
    print(f"decode:  {result.decode_tokens_per_s:.1f} tokens/s ({result.decode_tokens} timed tokens"
          + (f"; compile + warm-up {result.compile_s:.1f} s not counted" if args.compile else "") + ")")
    weights = ("unquantized" if args.weight_quant == "none"
               else f"{args.weight_quant} weight-only Linear layers (torchao); embeddings and norms {config['dtype']}")
    print(f"model:   {model_bytes / 2**20:.1f} MiB, {weights}")
    extras = "".join([f" sink={kivi_config.sink_tokens}" if kivi_config.sink_tokens else "",
                      f" outliers={kivi_config.outlier_tokens}" if kivi_config.outlier_tokens else "",
                      " pre-RoPE" if kivi_config.pre_rope else "",
                      f" nuq={args.nuq}" if kivi_config.has_nuq else "",
                      f" sparse={kivi_config.sparse_outliers:g}" if kivi_config.sparse_outliers else ""])
    label = (f"KIVI-{kivi_config.k_bits}/{kivi_config.v_bits} G={kivi_config.group_size} "
             f"R={kivi_config.residual_length}{extras}, {config['dtype']} scales and residual" if args.method == "kivi"
             else f"fp ({config['dtype']})")
    print(f"cache:   {result.cache_bytes / 2**20:.2f} MiB {label} vs {result.fp16_cache_bytes / 2**20:.2f} MiB "
          f"fp16 for {max_seq_len} tokens x {len(ids)} sequence(s): fp16 / this = {ratio:.2f}x"
          + (" (the full-precision residual window dominates a sequence this short)" if ratio < 1 else ""))
    context = model.config.max_position_embeddings
    if args.method == "kivi" and context > max_seq_len:
        # Same cache at the model's full context, built on the meta device (no memory).
        full = make_cache(model, method="kivi", batch_size=len(ids), max_seq_len=context, kivi_config=kivi_config,
                          device="meta").backing
        print(f"         at the full {context}-token context: {full.nbytes() / 2**20:.1f} MiB vs "
              f"{full.fp16_nbytes() / 2**20:.1f} MiB fp16 ({full.fp16_nbytes() / full.nbytes():.2f}x smaller)")
    return 0


def add_prompt_arguments(p: argparse.ArgumentParser, *, batch_help: str) -> None:
    """Where the prompts come from, and how many tokens to generate (generate, run-exported)."""
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="the prompt text")
    src.add_argument("--prompt-file", help="a file holding one prompt")
    src.add_argument("--batch-file", help=batch_help)
    p.add_argument("--max-new-tokens", type=positive_int, default=64)


def add_sampling_arguments(p: argparse.ArgumentParser) -> None:
    """Sampling, chat template and output format (generate, run-exported)."""
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=positive_int, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the tokenizer's chat template")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kivi", description="KIVI 2/4-bit KV-cache quantization for PyTorch")
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate text with a KIVI or fp static cache")
    add_prompt_arguments(g, batch_help="a file with one prompt per line (batched generation)")
    add_model_arguments(g)
    g.add_argument("--compile", action="store_true", help="torch.compile the decode step (CUDA graphs on GPU)")
    add_sampling_arguments(g)
    g.set_defaults(func=cmd_generate, parser=g)

    from kivi_benchmarks.bench_cli import add_bench_parser
    from kivi_benchmarks.calibrate import add_calibrate_parser
    from kivi_benchmarks.eval_cli import add_eval_parser

    from kivi_export.cli import add_export_parsers

    add_eval_parser(sub, add_model_arguments, positive_int)
    add_bench_parser(sub, add_model_arguments, positive_int)
    add_calibrate_parser(sub, add_model_arguments, positive_int)
    add_export_parsers(sub, add_model_arguments, positive_int)
    return parser


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        SamplingConfig(temperature=getattr(args, "temperature", 0.0), top_p=getattr(args, "top_p", None))
    except ValueError as e:
        args.parser.error(str(e))
    return args.func(args, args.parser)


if __name__ == "__main__":
    sys.exit(main())
