"""Docstrings and comments stay a small share of the code (issue 51: the code says what, a comment
says why, the docs hold the reference). Ceilings for what issue 51 cut; lab/prose_ratio.py measures."""

from lab.prose_ratio import ROOT, prose_lines, ratio

SAMPLE = '''"""A module doc
on two lines."""

x = "a string, not prose"  # a comment


def f():
    """One line."""
    # two comment
    # lines
    return """a string
    value"""
'''


def test_prose_lines_counts_docstrings_and_comments_only():
    assert prose_lines(SAMPLE) == (6, 9)  # lines 1, 2, 4, 8, 9, 10 of the 9 non-blank


def test_the_cut_packages_stay_under_their_ceiling():
    for paths, ceiling in (([ROOT / "models"], 0.16),
                           ([ROOT / "kivi_ops" / "dispatch" / "__init__.py", ROOT / "kivi_ops" / "dispatch" / "implementations.py"], 0.17)):
        prose, lines = ratio(paths)
        assert prose / lines <= ceiling, (paths, prose, lines)
