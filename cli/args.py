"""What the `kivi` subcommands share: the model and cache flags, the KIVIConfig they describe,
prompt and sampling flags, argument types, and usage errors.

The one module of shared CLI helpers. It imports no command module (kivi_cli.main, *_cli), so
every command module can import it and the CLI's imports flow one way (tests/test_imports.py):
kivi_cli.main (the `kivi` parser) -> command modules -> this module -> the library.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import re
import sys
from pathlib import Path

import torch

from kivi_ops import KIVIConfig
from kivi_ops.config import SUPPORTED_BITS, SUPPORTED_GROUP_SIZES
from kivi_ops.options.rotation import CACHE_ROTATIONS
from kivi_ops.options.schedule import POLICIES

from kivi_models.generate import METHODS
from kivi_models.loading import DEFAULT_MODEL

from kivi_benchmarks.presets import PRESET_FLAGS, PRESETS

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@contextlib.contextmanager
def usage_errors(parser: argparse.ArgumentParser, *errors: type[BaseException]):
    """Turns the given exceptions (default ValueError) raised inside into `parser.error(message)`:
    the usage line, `prog: error: message` and exit status 2. KIVIConfig / KIVICache field names
    in the message become the flags that set them (residual_length -> --residual-length)."""
    try:
        yield
    except (errors or (ValueError,)) as e:
        parser.error(flag_spelling(str(e)))


def flag_spelling(message: str) -> str:
    for field, flag in _FLAG_NAMES:
        message = re.sub(rf"\b{field}\b", flag, message)
    return message


def dumps_json(obj) -> str:
    """Strict JSON for --json output: a non-finite float (e.g. a rate over zero timed tokens)
    becomes null, never the bare NaN / Infinity that strict parsers reject."""
    def finite(x):
        if isinstance(x, float) and not math.isfinite(x):
            return None
        if isinstance(x, dict):
            return {k: finite(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [finite(v) for v in x]
        return x

    return json.dumps(finite(obj), allow_nan=False)


# Argument types.

def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def positive_ints(text: str) -> tuple[int, ...]:
    """A comma-separated list of positive integers, e.g. "8,16,32"."""
    try:
        values = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be positive integers separated by commas (e.g. 8,16,32), got {text!r}")
    if any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"must be positive integers, got {text!r}")
    return values


def non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {value}")
    return value


def positive_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


def non_negative_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return value


def fraction_arg(text: str) -> float:
    from kivi_ops.options.dense_sparse import check_outlier_fraction

    try:
        value = float(text)
        check_outlier_fraction(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a fraction in [0, 0.5), e.g. 0.01, got {text!r}")
    return value


SEED_RANGE = (-(2**63), 2**64)  # what torch.manual_seed takes (the low end inclusive)


def seed_int(text: str) -> int:
    low, high = SEED_RANGE
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or not low <= value < high:
        raise argparse.ArgumentTypeError(f"must be an integer in [-2**63, 2**64) (what torch.manual_seed takes), "
                                         f"got {text!r}")
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
                   help="'default' (the embedded SmolLM2-135M-Instruct), 'gemma3-270m' (the real Gemma 3 270M, the "
                        "`gemma3` extra), a GGUF file (converted once to the "
                        "model cache) or a local Hugging Face model directory")
    p.add_argument("--method", choices=methods, default="kivi", help="kivi: quantized cache; fp: unquantized static cache")
    p.add_argument("--k-bits", type=int, choices=SUPPORTED_BITS, default=2, action=_Explicit)
    p.add_argument("--v-bits", type=int, choices=SUPPORTED_BITS, default=2, action=_Explicit)
    p.add_argument("--group-size", type=int, choices=SUPPORTED_GROUP_SIZES, default=32, action=_Explicit)
    p.add_argument("--residual-length", type=int, default=128, action=_Explicit,
                   help="full-precision recent tokens (a multiple of --group-size under --flush-policy kivi; any "
                        "positive number under ott)")
    p.add_argument("--flush-policy", choices=POLICIES, default="kivi", action=_Explicit,
                   help="when tokens leave full precision. kivi (KIVI's Algorithm 1): keys are quantized R at a time "
                        "when their residual fills, values one by one as they leave the last R. ott (the OTT paper's "
                        "schedule): keys and values are both quantized G at a time, and the R most recent tokens "
                        "always stay exact (R and G independent, e.g. --group-size 128 --residual-length 32)")
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
    for part, what in (("keys", "keys (after RoPE)"), ("values", "values")):
        p.add_argument(f"--rotate-{part}", choices=CACHE_ROTATIONS, default="none", action=_Explicit,
                       help=f"store {what} rotated by an orthogonal matrix of the head dimension before "
                            "quantization (attention is unchanged): hadamard (Walsh-Hadamard; a seeded random "
                            "matrix if head_dim is not a power of two), random (seeded random orthogonal) or "
                            "calibrated (per layer and KV head, from --rotations; the KIVI cache only)")
    p.add_argument("--rotation-seed", type=seed_int, default=0, action=_Explicit, help="seed of the random rotation")
    p.add_argument("--rotations", default=None, metavar="PATH",
                   help="a `kivi calibrate` file whose fitted rotations --rotate-keys/--rotate-values calibrated use "
                        "(refused for another model or head_dim)")
    p.add_argument("--layer-bits", default=None, metavar="PATH",
                   help="per-layer key and value widths from a `kivi calibrate --bits-budget` file (same "
                        "--group-size as calibrated; refused for another model), in place of --k-bits/--v-bits")
    p.add_argument("--preset", choices=tuple(PRESETS), default=None,
                   help="; ".join(f"{name}: {what}" for name, what in PRESETS.items())
                        + ". Refused with the flags a preset sets (" + ", ".join(
                            "--" + flag.replace("_", "-") for flag in PRESET_FLAGS) + ")")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=tuple(DTYPES), default=None, help="default: float32 on cpu, float16 on cuda")
    from kivi_models.weight_quant import WEIGHT_QUANT_MODES

    p.add_argument("--weight-quant", choices=WEIGHT_QUANT_MODES, default="none",
                   help="torchao weight-only quantization of the Linear layers: int8 (cpu, cuda) or int4 (cuda)")


def _nuq_levels(args, parser, rotations, layer_bits: tuple) -> dict:
    """{"key_levels": ..., "value_levels": ...} for KIVIConfig from --nuq, checked against the model,
    the rotations and, per layer, at layer_bits' widths."""
    from kivi_ops.calibration.nuq import config_levels

    from kivi_models.loading import head_dim_of, model_identity, resolve_model_path

    with usage_errors(parser, ValueError, OSError):
        config = json.loads((resolve_model_path(args.model) / "config.json").read_text())
        return config_levels(args.nuq, k_bits=args.k_bits, v_bits=args.v_bits, num_layers=config["num_hidden_layers"],
                             group_size=args.group_size, pre_rope=args.pre_rope, sparse_outliers=args.sparse_outliers,
                             model=model_identity(args.model), head_dim=head_dim_of(config),
                             rotate_keys=args.rotate_keys, rotate_values=args.rotate_values, rotations=rotations,
                             layer_bits=layer_bits)


def _apply_preset(args, parser, method: str) -> None:
    """Sets the flags --preset stands for (kivi_benchmarks.presets.preset_settings) on args; refuses
    any flag a preset sets given with it."""
    from kivi_benchmarks.presets import PRESET_FLAGS, preset_settings

    given = [f"--{name.replace('_', '-')}" for name in PRESET_FLAGS
             if name in getattr(args, "explicit", set()) or getattr(args, name) != parser.get_default(name)]
    if given:
        parser.error(f"--preset {args.preset} sets {' / '.join(given)} itself; leave them out (or leave out --preset)")
    if method != "kivi":
        parser.error(f"--preset is an option of the KIVI cache (--method kivi), not of --method {method}")
    with usage_errors(parser, ValueError, OSError):
        settings = preset_settings(args.preset, args.model)
    for name, value in settings.items():
        setattr(args, name, value)


def _calibration_identity(args) -> dict:
    from kivi_benchmarks.presets import calibration_identity

    return calibration_identity(args.model)


def _layer_bits(args, parser, method: str) -> tuple:
    """KIVIConfig.layer_bits from --layer-bits, checked against the model and --group-size."""
    if not args.layer_bits:
        return ()
    if method != "kivi":
        parser.error(f"--layer-bits is an option of the KIVI cache (--method kivi), not of --method {method}")
    given = getattr(args, "explicit", set()) & {"k_bits", "v_bits"}
    if given:
        parser.error(f"--layer-bits sets each layer's widths; leave out "
                     f"{' / '.join(sorted('--' + g.replace('_', '-') for g in given))}")
    from kivi_ops.calibration.layer_bits import load_layer_bits

    with usage_errors(parser, ValueError, OSError):
        widths, section = load_layer_bits(args.layer_bits, _calibration_identity(args))
    if section["group_size"] != args.group_size:
        parser.error(f"--layer-bits {args.layer_bits}: its widths were chosen at --group-size {section['group_size']} "
                     f"(layer_bits.group_size), got --group-size {args.group_size}")
    return widths


def _calibrated_rotations(args, parser, method: str):
    """KIVIConfig.rotations from --rotations when a rotation is "calibrated", checked against the model."""
    calibrated = "calibrated" in (args.rotate_keys, args.rotate_values)
    if not calibrated:
        if args.rotations:
            parser.error("--rotations is used only with --rotate-keys calibrated or --rotate-values calibrated")
        return None
    if method != "kivi":
        parser.error(f"--rotate-keys/--rotate-values calibrated are options of the KIVI cache (--method kivi), "
                     f"not of --method {method}")
    if not args.rotations:
        parser.error("--rotate-keys/--rotate-values calibrated need --rotations PATH (a `kivi calibrate` file)")
    from kivi_ops.calibration.rotations import load_rotations

    with usage_errors(parser, ValueError, OSError):
        return load_rotations(args.rotations, _calibration_identity(args), keys=args.rotate_keys == "calibrated")


# CLI spelling of the KIVIConfig fields in error messages.
_FLAG_NAMES = (("sink_tokens", "--sink-tokens"), ("outlier_tokens", "--outlier-tokens"),
               ("outlier_spill", "--outlier-spill"), ("outlier_skip_layers", "--outlier-skip-layers"),
               ("sparse_outliers", "--sparse-outliers"), ("residual_length", "--residual-length"),
               ("group_size", "--group-size"), ("k_bits", "--k-bits"), ("v_bits", "--v-bits"),
               ("flush_policy", "--flush-policy"), ("rotate_keys", "--rotate-keys"),
               ("rotate_values", "--rotate-values"), ("rotation_seed", "--rotation-seed"),
               ("bits_budget", "--bits-budget"), ("temperature", "--temperature"), ("top_p", "--top-p"), ("top_k", "--top-k"))
# Flags that only configure the KIVI cache; given explicitly with --method fp they are refused
# (their defaults are not, so that `--method fp` alone works).
_KIVI_ONLY_FLAGS = ("k_bits", "v_bits", "group_size", "residual_length", "flush_policy", "rotate_keys",
                    "rotate_values", "rotation_seed")


class _Explicit(argparse.Action):
    """Stores the value and notes that the user gave the flag (args.explicit)."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, values)
        namespace.explicit = getattr(namespace, "explicit", set()) | {self.dest}


def kivi_config_from(args, parser) -> KIVIConfig:
    """The KIVIConfig the flags describe. KVQuant's flags (--pre-rope, --nuq, --sparse-outliers)
    configure the cache for --method kivi; --method fake applies them itself (eval ppl)."""
    method = getattr(args, "method", "kivi")
    if args.preset:
        _apply_preset(args, parser, method)
    kvquant = dict(pre_rope=args.pre_rope, sparse_outliers=args.sparse_outliers)
    rotations = _calibrated_rotations(args, parser, method)
    layer_bits = _layer_bits(args, parser, method)
    if method == "kivi" and args.nuq:
        kvquant.update(_nuq_levels(args, parser, rotations, layer_bits))
    try:
        config = KIVIConfig(k_bits=args.k_bits, v_bits=args.v_bits, group_size=args.group_size,
                            residual_length=args.residual_length, sink_tokens=args.sink_tokens,
                            outlier_tokens=args.outlier_tokens, outlier_spill=args.outlier_spill,
                            outlier_skip_layers=args.outlier_skip_layers, flush_policy=args.flush_policy,
                            rotate_keys=args.rotate_keys, rotate_values=args.rotate_values,
                            rotation_seed=args.rotation_seed, rotations=rotations,
                            layer_bits=layer_bits, **(kvquant if method == "kivi" else {}))
    except ValueError as e:
        parser.error(flag_spelling(str(e)))
    if method == "fp" and getattr(args, "explicit", set()) & set(_KIVI_ONLY_FLAGS):
        given = sorted(flag for field, flag in _FLAG_NAMES if field in args.explicit)
        parser.error(f"{' / '.join(given)}: options of the KIVI cache (--method kivi), not of --method fp "
                     "(the fp cache stores every token unquantized)")
    if method != "kivi" and config.has_pool:
        parser.error(f"--sink-tokens / --outlier-tokens are options of the KIVI cache (--method kivi), "
                     f"not of --method {method}")
    if method == "fp" and (args.pre_rope or args.nuq or args.sparse_outliers):
        parser.error("--pre-rope / --nuq / --sparse-outliers are options of the KIVI cache (--method kivi) "
                     "or of fake quantization (--method fake), not of --method fp")
    return config


def bits_report(patched_model, method: str, kivi_config, tokens: int) -> dict:
    """--json's bits_per_element: stored bits per cached key/value element of one sequence of
    `tokens` (the evaluated length) in the full-attention layers, fp16 scales, zeros and the fp
    window counted (kivi_benchmarks.perplexity.cache_bits_per_element)."""
    from kivi_benchmarks.perplexity import cache_bits_per_element

    return dict(bits_per_element=cache_bits_per_element(patched_model, method, kivi_config if method == "kivi" else None,
                                                        tokens),
                bits_per_element_tokens=tokens)


def device_and_dtype(args, parser) -> tuple[str, torch.dtype]:
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda was requested but no CUDA device is available")
    dtype = DTYPES[args.dtype] if args.dtype else (torch.float16 if args.device == "cuda" else torch.float32)
    return args.device, dtype


def check_weight_quant_modes(modes, device: str, parser) -> None:
    """--weight-quant mode(s) usable on this device, or a usage error."""
    from kivi_models.weight_quant import check_weight_quant

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
    p.add_argument("--seed", type=seed_int, default=None)
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the tokenizer's chat template")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")


def read_prompts(args, parser) -> list[str]:
    """The prompts, each non-empty. A --batch-file holds one prompt per line; a blank line is
    refused (naming it) rather than skipped, so that result i always belongs to line i."""
    if args.prompt is not None:
        if not args.prompt.strip():
            parser.error("--prompt is empty; give the text to continue")
        return [args.prompt]
    flag, path = ("--prompt-file", args.prompt_file) if args.prompt_file is not None else ("--batch-file", args.batch_file)
    try:
        text = Path(path).read_text(encoding="utf-8-sig")  # a byte-order mark is not part of the prompt
    except UnicodeDecodeError:
        parser.error(f"{flag} {path} is not UTF-8 text")
    except OSError as e:
        parser.error(f"cannot read {flag} {path}: {e.strerror or e}")
    if flag == "--prompt-file":
        text = text.rstrip("\n")
        if not text.strip():
            parser.error(f"--prompt-file {path} is empty")
        return [text]
    # "\n" only (a trailing "\r" is part of the line ending): str.splitlines() would also split at
    # form feeds, U+2028 and other characters a prompt may hold, and result i would no longer be line i.
    prompts = [line.removesuffix("\r") for line in text.removesuffix("\n").split("\n")] if text else []
    if not prompts:
        parser.error(f"--batch-file {path} holds no prompts (one per line)")
    blank = [i + 1 for i, line in enumerate(prompts) if not line.strip()]
    if blank:
        parser.error(f"--batch-file {path}: line(s) {', '.join(map(str, blank[:10]))} are blank; each line is one "
                     "prompt and results follow the lines in order, so remove blank lines")
    return prompts


def warn_unused_sampling(args) -> None:
    """Top-k / top-p only shape sampling: with greedy decoding (temperature 0) say they do nothing."""
    if args.temperature == 0 and (args.top_k is not None or args.top_p is not None):
        print("kivi: warning: --top-k / --top-p have no effect with greedy decoding (--temperature 0); "
              "set --temperature > 0 to sample", file=sys.stderr)


def encode(tokenizer, prompt: str, chat: bool) -> list[int]:
    if chat:
        return tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                             tokenize=True, return_dict=False)
    return tokenizer(prompt)["input_ids"]


def available_memory(device: str) -> int:
    """Bytes free for new tensors: the GPU's free memory, or the machine's MemAvailable."""
    if device == "cuda":
        return torch.cuda.mem_get_info()[0]
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 1 << 62  # no /proc/meminfo (not Linux): no check


def check_memory(nbytes: int, device: str, *, what: str) -> None:
    """Refuse (MemoryError: the CLI exits 1) before allocating more than the device has free."""
    free = available_memory(device)
    if nbytes > free:
        raise MemoryError(f"{what} needs {nbytes / 2**30:.2f} GiB but only {free / 2**30:.2f} GiB is free on {device}; "
                          "use fewer or shorter prompts, a smaller --max-new-tokens, or fewer --k-bits/--v-bits")


# Output of a generation (generate, run-exported).

def generation_report(tokenizer, result) -> tuple[list[str], dict]:
    """The decoded texts and the report fields `kivi generate` and `kivi run-exported` share;
    per-prompt fields are lists when batched, single values otherwise."""
    texts = [tokenizer.decode(t, skip_special_tokens=True) for t in result.tokens]
    one = len(texts) == 1
    report = {
        "text": texts[0] if one else texts,
        "tokens": result.tokens[0] if one else result.tokens,
        "prompt_tokens": result.prompt_tokens[0] if one else result.prompt_tokens,
        "new_tokens": len(result.tokens[0]) if one else [len(t) for t in result.tokens],
        "prefill_tokens_per_s": result.prefill_tokens_per_s,
        "decode_tokens_per_s": result.decode_tokens_per_s,
    }
    return texts, report


def print_generations(prompts: list[str], texts: list[str], chat: bool) -> None:
    """Each prompt with its continuation (the reply alone with --chat), separated when batched."""
    for prompt, text in zip(prompts, texts):
        print(text if chat else f"{prompt}{text}")
        if len(texts) > 1:
            print("-" * 40)
