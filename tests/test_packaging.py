"""The wheel carries every package: pyproject.toml lists packages by hand (they install under other
names, kivi_models for models/ ...), so a new subpackage that is not listed would be missing from a
non-editable install while every test here (editable) still passes."""

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_package_directory_is_listed_in_pyproject():
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(setuptools["packages"])
    for name, folder in setuptools["package-dir"].items():
        for init in (ROOT / folder).rglob("__init__.py"):
            sub = init.parent.relative_to(ROOT / folder).parts
            assert ".".join((name, *sub)) in listed, f"{init.parent} is not in [tool.setuptools] packages"


def test_the_cuda_sources_ship_with_the_package():
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    sources = {p.suffix for p in (ROOT / "kivi_ops" / "kernels" / "cuda").iterdir() if p.suffix in (".cu", ".h", ".cpp")}
    assert sources and {pattern[1:] for pattern in data["kivi_ops.kernels.cuda"]} >= sources
