"""The `kivi` command line: the top-level parser, where every subcommand is registered.

Every command module lives here, in cli/, above the packages whose work it runs, so imports flow
one way (tests/test_imports.py checks it):

    kivi_cli.main          this parser and main(); only `python -m kivi_cli` imports it
      -> command modules   each adds its subcommand(s) and runs them:
           generate.py       generate
           serve.py          serve
           calibrate.py      calibrate
           evaluate.py       eval ppl | passkey | table
           bench.py          bench memory | attention | decode | weight-quant | serve | hf-generate
           export.py         export, run-exported
      -> args.py           the flags, argument types and usage errors they share
      -> the library       kivi_ops, kivi_models, kivi_serve, kivi_export, kivi_benchmarks
"""

from __future__ import annotations

import argparse
import sys

import torch

from kivi_models.generate import SamplingConfig
from kivi_models.parallel import check_launch, rank_zero_output

from .args import flag_spelling, usage_errors
from .bench import add_bench_parser
from .calibrate import add_calibrate_parser
from .evaluate import add_eval_parser
from .export import add_export_parsers
from .generate import add_generate_parser
from .serve import add_serve_parser

# In `kivi --help` order.
SUBCOMMANDS = (add_generate_parser, add_serve_parser, add_eval_parser, add_bench_parser, add_calibrate_parser,
               add_export_parsers)


# A user's mistake or the environment, reported as one line (exit 2: usage, 1: environment);
# anything else is a bug and keeps its traceback. --debug shows the traceback for these too.
USAGE_ERRORS = (ValueError,)  # bad values reaching the library (UnicodeDecodeError, JSONDecodeError too)
ENVIRONMENT_ERRORS = (OSError, MemoryError, torch.OutOfMemoryError, FloatingPointError)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kivi", description="KIVI 2/4-bit KV-cache quantization for PyTorch")
    sub = parser.add_subparsers(dest="command", required=True)
    for add_parser in SUBCOMMANDS:
        add_parser(sub)
    _add_debug_flag(parser)
    return parser


def _add_debug_flag(parser: argparse.ArgumentParser) -> None:
    """--debug on every leaf command (`kivi generate ... --debug`, `kivi eval ppl ... --debug`)."""
    subparsers = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subparsers:
        parser.add_argument("--debug", action="store_true", help="show the Python traceback of an error")
    for action in subparsers:
        for child in action.choices.values():
            _add_debug_flag(child)


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    with usage_errors(args.parser):
        SamplingConfig(temperature=getattr(args, "temperature", 0.0), top_p=getattr(args, "top_p", None))
        check_launch(args.command)
    try:
        with rank_zero_output():
            return args.func(args, args.parser)
    except USAGE_ERRORS + ENVIRONMENT_ERRORS as e:
        if args.debug:
            raise
        print(f"{args.parser.prog}: error: {flag_spelling(str(e))}", file=sys.stderr)
        return 2 if isinstance(e, USAGE_ERRORS) else 1
