"""What the `kivi` subcommands share: the model and cache flags, the KIVIConfig they describe,
prompt and sampling flags, argument types, and usage errors.

The one module of shared CLI helpers. It imports no command module (kivi_models.cli, *_cli), so
every command module can import it and the CLI's imports flow one way (tests/test_imports.py):
kivi_models.cli (the `kivi` parser) -> command modules -> this module -> the library.
"""

from __future__ import annotations

import argparse
import contextlib
import json
from pathlib import Path

import torch

from kivi_ops import KIVIConfig
from kivi_ops.config import SUPPORTED_BITS, SUPPORTED_GROUP_SIZES

from .generate import METHODS
from .loading import DEFAULT_MODEL

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@contextlib.contextmanager
def usage_errors(parser: argparse.ArgumentParser, *errors: type[BaseException]):
    """Turns the given exceptions (default ValueError) raised inside into `parser.error(message)`:
    the usage line, `prog: error: message` and exit status 2."""
    try:
        yield
    except (errors or (ValueError,)) as e:
        parser.error(str(e))


# Argument types.

def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def fraction_arg(text: str) -> float:
    from kivi_ops.dense_sparse import check_outlier_fraction

    try:
        value = float(text)
        check_outlier_fraction(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a fraction in [0, 0.5), e.g. 0.01, got {text!r}")
    return value


def int_list(text: str) -> list[int]:
    """Comma-separated token counts, each >= 16 (context lengths)."""
    try:
        values = [int(x) for x in text.split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}")
    if not values or min(values) < 16:
        raise argparse.ArgumentTypeError(f"expected comma-separated lengths >= 16, got {text!r}")
    return values


# Model and cache flags, and the KIVIConfig they describe.

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


def _nuq_levels(args, parser) -> dict:
    """{"key_levels": ..., "value_levels": ...} for KIVIConfig from --nuq, checked against the model."""
    from kivi_ops.nuq import config_levels

    from .loading import resolve_model_path

    with usage_errors(parser, ValueError, OSError):
        num_layers = json.loads((resolve_model_path(args.model) / "config.json").read_text())["num_hidden_layers"]
        return config_levels(args.nuq, k_bits=args.k_bits, v_bits=args.v_bits, num_layers=num_layers,
                             group_size=args.group_size, pre_rope=args.pre_rope, sparse_outliers=args.sparse_outliers)


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


def check_weight_quant_modes(modes, device: str, parser) -> None:
    """--weight-quant mode(s) usable on this device, or a usage error."""
    from .weight_quant import check_weight_quant

    with usage_errors(parser):
        for mode in modes:
            check_weight_quant(mode, device)


# Prompts and sampling (generate, run-exported).

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
