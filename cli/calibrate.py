"""`kivi calibrate`: derive per-layer nuqX levels and per layer and KV head rotations offline
(kivi_models.calibrate) and write them to a calibration file (kivi_ops.calibration.nuq, kivi_ops.calibration.rotations)."""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path

import torch

from .args import fraction_arg, positive_float, positive_int, usage_errors


def add_calibrate_parser(sub) -> None:
    c = sub.add_parser("calibrate", help="derive per-layer nuqX levels (KVQuant), rotations and, under a "
                                          "budget, per-layer bit widths offline")
    c.add_argument("--out", type=Path, required=True, help="the JSON file to write")
    c.add_argument("--model", default="default")
    c.add_argument("--text", default=None, help="a text file (default: the pydoc corpus)")
    c.add_argument("--bits", type=_bits_list, default=[2, 4], help="comma-separated, from 2,3,4 (default 2,4)")
    c.add_argument("--group-size", type=positive_int, default=32)
    c.add_argument("--window", type=positive_int, default=512)
    c.add_argument("--windows", type=positive_int, default=8)
    c.add_argument("--pre-rope", action="store_true", help="levels for keys quantized before RoPE (KVQuant)")
    c.add_argument("--sparse-outliers", type=fraction_arg, default=0.0, metavar="FRACTION",
                   help="levels for the dense part when this fraction of each vector is kept exact (e.g. 0.01)")
    c.add_argument("--rotation-bits", type=int, choices=(2, 3, 4), default=2,
                   help="also fit per layer and KV head rotations (--rotate-keys/--rotate-values calibrated) "
                        "for this bit width (default 2)")
    c.add_argument("--no-rotations", action="store_true", help="fit the nuq levels only")
    c.add_argument("--rotations-nuq", action="store_true",
                   help="choose each head's rotation by its error on nuq levels fitted to it (for a cache that "
                        "takes this file's --nuq too), not on the uniform grid")
    c.add_argument("--learned-rotations", action="store_true",
                   help="refine each head's chosen rotation by gradient descent on its Fisher-weighted error, kept "
                        "where it lowers the error on held-out calibration windows (about 2 s a head)")
    c.add_argument("--bits-budget", type=positive_float, default=None, metavar="BITS",
                   help="also choose 2/3/4-bit widths per layer, keys and values apart, by their Fisher-weighted "
                        "error (in the fitted rotations' basis), within BITS stored bits per key/value element "
                        "(scales, zeros and the fp window counted, at --budget-tokens with --group-size and "
                        "--residual-length); the cache takes them with --layer-bits FILE")
    c.add_argument("--budget-nuq", action="store_true",
                   help="choose the --bits-budget widths by each width's error on its fitted nuq levels (for a "
                        "cache that takes this file's --nuq too; needs --bits 2,3,4), not on the uniform grid")
    c.add_argument("--residual-length", type=positive_int, default=128, help="the fp window the budget counts")
    c.add_argument("--budget-tokens", type=positive_int, default=4096, help="the sequence length the budget counts")
    c.set_defaults(func=cmd_calibrate, parser=c)


def _bits_list(text: str) -> list[int]:
    try:
        bits = [int(x) for x in text.split(",") if x]
    except ValueError:
        bits = []
    if not bits or any(b not in (2, 3, 4) for b in bits):
        raise argparse.ArgumentTypeError(f"expected comma-separated bit widths from 2,3,4, got {text!r}")
    return bits


def cmd_calibrate(args, parser) -> int:
    from kivi_ops.calibration.rotations import model_identity as rotation_identity
    from kivi_ops.config import check_group_size
    from kivi_ops.calibration.nuq import write_levels_file

    from kivi_models.calibrate import run_calibration
    from kivi_models.corpus import load_text
    from kivi_models.loading import load_model, model_identity, resolve_model_path

    with usage_errors(parser, ValueError, OSError):
        check_group_size("--group-size", args.group_size)
        text = load_text(text_file=args.text, corpus=None if args.text else "pydoc")
    for flag in ("rotations_nuq", "learned_rotations"):
        if getattr(args, flag) and args.no_rotations:
            parser.error(f"--{flag.replace('_', '-')} chooses the rotations; leave out --no-rotations")
    if args.learned_rotations and args.windows < 2:
        parser.error("--learned-rotations holds out a quarter of the calibration windows: give --windows 2 or more")
    if args.window % args.group_size:
        parser.error(f"--window must be a multiple of --group-size={args.group_size}")
    model, tokenizer = load_model(args.model, dtype=torch.float32, device="cpu")
    name = model_identity(args.model)
    identity = rotation_identity(json.loads((resolve_model_path(args.model) / "config.json").read_text()), name)
    with usage_errors(parser):
        result = run_calibration(model, tokenizer, text, bits_list=args.bits, group_size=args.group_size,
                                 window=args.window, windows=args.windows, model_name=name,
                                 pre_rope=args.pre_rope, sparse_outliers=args.sparse_outliers,
                                 rotation_bits=None if args.no_rotations else args.rotation_bits, identity=identity,
                                 bits_budget=args.bits_budget, residual_length=args.residual_length,
                                 budget_tokens=args.budget_tokens, budget_nuq=args.budget_nuq,
                                 rotations_nuq=args.rotations_nuq, learned_rotations=args.learned_rotations)
    write_levels_file(args.out, result)
    if "rotations" in result:
        for part, name in (("k", "keys"), ("v", "values")):
            kinds = Counter(h["kind"] for layer in result["rotations"]["layers"] for h in layer[part])
            print(f"rotations, {name} ({args.rotation_bits}-bit): " + ", ".join(f"{k} {n}" for k, n in kinds.most_common()))
    if "layer_bits" in result:
        section = result["layer_bits"]
        kinds = Counter(f"K{k}V{v}" for (k, v), full in zip(section["layers"], section["full_attention"]) if full)
        print(f"layer widths within {args.bits_budget} bits per element: {section['bits_per_element']} "
              f"({', '.join(f'{k} {n}' for k, n in kinds.most_common())})")
    for bits, entry in result["bits"].items():
        k, v = entry["k_error_vs_uniform"], entry["v_error_vs_uniform"]
        print(f"nuq{bits}: Fisher-weighted error vs the uniform grid, mean over {len(k)} layers: "
              f"keys {sum(k) / len(k):.3f}, values {sum(v) / len(v):.3f}")
    print(f"wrote {args.out} ({result['calibration']['tokens']} tokens, {result['calibration']['seconds']} s)")
    return 0
