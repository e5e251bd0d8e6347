"""The README's CLI table says what `kivi --help` offers: the same subcommands in the same order,
and for `eval` and `bench` the same sub-subcommands."""

import argparse
import re
from pathlib import Path

from kivi_cli.main import build_parser

README = Path(__file__).resolve().parent.parent / "README.md"


def _choices(parser: argparse.ArgumentParser) -> list[str]:
    (action,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return list(action.choices)


def _readme_table() -> dict[str, str]:
    """subcommand -> its "what it does" cell, from the README's table under "The CLI"."""
    rows = re.findall(r"^\| `([a-z-]+)` \| (.*) \|$", README.read_text(), flags=re.M)
    assert rows, "no CLI table in README.md"
    return dict(rows)


def test_readme_table_lists_every_subcommand_in_help_order():
    parser = build_parser()
    table = _readme_table()
    assert list(table) == _choices(parser)
    count = re.search(r"One command, `kivi`, with (\w+) subcommands", README.read_text()).group(1)
    words = ["one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten"]
    assert words.index(count) + 1 == len(table)


def test_readme_table_names_the_eval_and_bench_commands():
    parser = build_parser()
    table = _readme_table()
    subparsers = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)][0].choices
    for command in ("eval", "bench"):
        named = re.findall(r"`([a-z-]+)`", table[command])
        assert named == _choices(subparsers[command]), command
