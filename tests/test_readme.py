"""The README says what the code and the results say: its CLI table is `kivi --help`'s (the same
subcommands in the same order, and for `eval` and `bench` the same sub-subcommands), and every
figure of its results table is in the committed file the row names."""

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


# The README's results are its "## Results" table, each row naming its source files; no result is
# quoted anywhere else, so a stale figure cannot read as current.
ROOT = README.parent
NUMBER = re.compile(r"(?<![\w.])(\d+(?:\.\d+)?)(x?)(?![\w.])")
# What a measured figure looks like in prose: a ratio, a share, a rate or a size, or a decimal with
# two places (a PPL). Dotted versions (2.13.0) and flags in code spans are not figures.
RESULT_LIKE = re.compile(r"(?<![\w.])\d+(?:\.\d+)?(?:x\b|%|\s*(?:tokens/s|tok/s|GiB|GB|MB|ms)\b)|"
                         r"(?<![\w.])\d+\.\d\d+(?![\w.])")


def _section(text: str, title: str) -> str:
    match = re.search(rf"^## {title}\n(.*?)(?=^## |\Z)", text, flags=re.M | re.S)
    assert match, f"no '## {title}' section in README.md"
    return match.group(1)


def _results_rows(text: str) -> list[list[str]]:
    rows = [[cell.strip() for cell in line.strip("|").split(" | ")]
            for line in _section(text, "Results").splitlines() if line.startswith("| ")]
    assert rows[0] == ["result", "value", "measured on", "source"], rows[0]
    return rows[2:]  # past the header's --- line


def _json_numbers(value) -> list[float]:
    if isinstance(value, dict):
        return [n for v in value.values() for n in _json_numbers(v)]
    if isinstance(value, list):
        return [n for v in value for n in _json_numbers(v)]
    return [value] if isinstance(value, (int, float)) and not isinstance(value, bool) else []


def _in_source(figure: str, suffix: str, texts: dict[Path, str]) -> bool:
    """Whether `figure` (as printed: 13.10, 5.22 of 5.22x, 394) is written in one of the sources:
    as the same token in a text (a ratio with its x), or a JSON number rounded to its places."""
    token = re.compile(rf"(?<![\w.]){re.escape(figure + suffix)}(?![\w.])")
    places = len(figure.partition(".")[2])
    for path, text in texts.items():
        if token.search(text):
            return True
        if path.suffix == ".json":
            import json

            if any(f"{round(n, places):.{places}f}" == figure for n in _json_numbers(json.loads(text))):
                return True
    return False


def _figure_errors(readme: str) -> list[str]:
    errors = []
    rows = _results_rows(readme)
    assert len(rows) >= 5
    for result, value, measured_on, source in rows:
        links = re.findall(r"\]\(([^)#]+)", source)
        assert links, f"the results row {result!r} links no source"
        paths = [ROOT / link for link in links]
        for path in paths:
            assert path.is_file() and path.relative_to(ROOT).parts[:2] == ("benchmarks", "results"), path
        texts = {path: path.read_text() for path in paths}
        figures = NUMBER.findall(value)
        assert figures, f"the results row {result!r} has no figure"
        errors += [f"{result!r}: {figure}{suffix} is in none of {links}"
                   for figure, suffix in figures if not _in_source(figure, suffix, texts)]
        sha, dirty = re.search(r"\b([0-9a-f]{7,40})(\+?) \|?", measured_on + " |").groups()
        pattern = re.escape(sha) + r"[0-9a-f]*" + (r"\+uncommitted" if dirty else r"(?![0-9a-f+])")
        if not any(re.search(pattern, text) for text in texts.values()):
            errors.append(f"{result!r}: commit {sha}{dirty} is recorded in none of {links}")
    return errors


def _prose(text: str) -> str:
    """The README without its code blocks, code spans and the results section."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)
    text = re.sub(r"`[^`\n]*`", "", text)
    return text.replace(_section(text, "Results"), "")


def test_every_figure_of_the_results_table_is_in_its_source():
    assert _figure_errors(README.read_text()) == []


def test_a_changed_figure_or_commit_fails_the_check():
    readme = README.read_text()
    value = _results_rows(readme)[0][1]  # 13.10 / 13.19 / 16.34
    changed = readme.replace(f"| {value} |", f"| {value.replace('16.34', '16.35')} |", 1)
    assert any("16.35" in e for e in _figure_errors(changed))
    assert any("commit" in e for e in _figure_errors(readme.replace("cc38ac0", "cc38ac1", 1)))
    assert any("commit" in e for e in _figure_errors(readme.replace("6893dcc+", "6893dcc", 1)))  # it was dirty


def test_no_result_is_quoted_outside_the_results_table():
    assert RESULT_LIKE.findall(_prose(README.read_text())) == []
    assert RESULT_LIKE.findall(_prose("## Results\n\n## Next\nKIVI-2 runs 1.35x faster")) == ["1.35x"]


def test_the_readme_stays_a_short_guide():
    assert len(README.read_text().splitlines()) <= 200
