"""Docstring and comment lines as a share of the non-blank lines of a package's Python files
(issue 51's measure: the code says what, a comment says why)."""

from __future__ import annotations

import argparse
import ast
import io
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def prose_lines(source: str) -> tuple[int, int]:
    """(lines holding a comment or a docstring, non-blank lines) of one file's source."""
    prose = {tok.start[0] for tok in tokenize.generate_tokens(io.StringIO(source).readline)
             if tok.type == tokenize.COMMENT}
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
                prose.update(range(first.lineno, first.end_lineno + 1))
    lines = source.splitlines()
    non_blank = {i for i, line in enumerate(lines, 1) if line.strip()}
    return len(prose & non_blank), len(non_blank)


def ratio(paths: list[Path]) -> tuple[int, int]:
    """(prose lines, non-blank lines) summed over every .py file under the paths (files or folders)."""
    files = [f for p in paths for f in ([p] if p.is_file() else sorted(p.rglob("*.py")))]
    counts = [prose_lines(f.read_text()) for f in files]
    return sum(c[0] for c in counts), sum(c[1] for c in counts)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m lab prose_ratio", description=__doc__)
    parser.add_argument("paths", nargs="*", default=["kivi_ops", "serve", "models"])
    for name in parser.parse_args(argv).paths:
        prose, lines = ratio([ROOT / name])
        print(f"{name:40s} {prose:6d} / {lines:6d} = {prose / lines:6.1%}")


if __name__ == "__main__":
    main()
