"""The `kivi` command line: the top-level parser, where every subcommand is registered.

Imports flow one way (tests/test_imports.py checks it):

    kivi_models.cli                 this parser and main(); nothing imports it
      -> command modules            each adds its subcommand(s) and runs them:
           kivi_models.generate_cli     generate
           kivi_models.calibrate_cli    calibrate
           kivi_benchmarks.eval_cli     eval ppl | passkey | table
           kivi_benchmarks.bench_cli    bench memory | attention | decode | weight-quant
           kivi_export.cli              export, run-exported
      -> kivi_models.cli_args       the flags, argument types and usage errors they share
      -> the library                kivi_ops, kivi_models (kivi_export, kivi_benchmarks for theirs)
"""

from __future__ import annotations

import argparse
import sys

from kivi_benchmarks.bench_cli import add_bench_parser
from kivi_benchmarks.eval_cli import add_eval_parser
from kivi_export.cli import add_export_parsers

from .calibrate_cli import add_calibrate_parser
from .cli_args import usage_errors
from .generate import SamplingConfig
from .generate_cli import add_generate_parser
from .parallel import check_launch, rank_zero_output

# In `kivi --help` order.
SUBCOMMANDS = (add_generate_parser, add_eval_parser, add_bench_parser, add_calibrate_parser, add_export_parsers)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kivi", description="KIVI 2/4-bit KV-cache quantization for PyTorch")
    sub = parser.add_subparsers(dest="command", required=True)
    for add_parser in SUBCOMMANDS:
        add_parser(sub)
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    with usage_errors(args.parser):
        SamplingConfig(temperature=getattr(args, "temperature", 0.0), top_p=getattr(args, "top_p", None))
        check_launch(args.command)
    with rank_zero_output():
        return args.func(args, args.parser)


if __name__ == "__main__":
    sys.exit(main())
