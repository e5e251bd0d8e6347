"""The project's import graph: no cycles, and the layers import downward only.

Every module of the four packages is parsed with `ast` (nothing is imported), and every import
statement counts, at module level or inside a function: a function-level import that closes a
cycle is still a cycle in the design, only a deferred one. An import resolves to the most specific
project module it names: `from pkg import name` is an edge to pkg.name when that is a module, else
to pkg (its __init__); `import a.b` is an edge to a.b. Importing a.b also runs a/__init__.py, but
that is not counted as an edge from the importer to `a` (a module of `a` importing a sibling would
otherwise always "cycle" through its own package); the package's __init__ is a module like any
other, with the edges of its own imports.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Installed package name -> source folder (pyproject.toml [tool.setuptools.package-dir]).
PACKAGES = {"kivi_ops": "kivi_ops", "kivi_models": "models", "kivi_serve": "serve", "kivi_export": "export",
            "kivi_benchmarks": "benchmarks", "kivi_cli": "cli"}
# The `kivi` entry point: the one module that registers the subcommands, so the one that imports
# the command modules (kivi_cli's other modules). Its package sits above the others; nothing imports it.
ENTRY = "kivi_cli.main"
RUNNER = "kivi_cli.__main__"  # `python -m kivi_cli` (torchrun launches the command so)
# The helpers every subcommand shares (model and cache flags, config from flags, usage errors).
CLI_HELPERS = "kivi_cli.args"
# What may import what, package by package (a package always imports itself). kivi_ops is the base;
# kivi_models the Hugging Face library on it; serving, export and benchmarks build on those two (the
# serving benchmark on kivi_serve too); kivi_cli, the command line, sits above them all.
ALLOWED = {
    "kivi_ops": {"kivi_ops"},
    "kivi_models": {"kivi_ops", "kivi_models"},
    "kivi_serve": {"kivi_ops", "kivi_models", "kivi_serve"},
    "kivi_export": {"kivi_ops", "kivi_models", "kivi_export"},
    "kivi_benchmarks": {"kivi_ops", "kivi_models", "kivi_serve", "kivi_benchmarks"},
    "kivi_cli": set(PACKAGES),
}
# kivi_ops's floors, bottom up (docs/design.md, "Where things live"). A module imports its own group
# or any group of a lower floor, never up, nor a sibling group of its floor: the kernel families
# stand side by side on the reference. The top-level modules and options/ are one group (config
# checks the options' settings, dense_sparse reads config's checks); the cycle test keeps it acyclic.
# A module is placed by the longest prefix here ("kivi_ops" itself, the public names, only exactly).
FLOORS = (
    (("kivi_ops.config", "kivi_ops.layout", "kivi_ops.paged_layout", "kivi_ops.devices", "kivi_ops.options"),),
    (("kivi_ops.kernels.reference",),),
    (("kivi_ops.kernels.decomposed",), ("kivi_ops.kernels.triton",), ("kivi_ops.kernels.cuda",), ("kivi_ops.kernels",)),
    (("kivi_ops.dispatch",),),
    (("kivi_ops.ops",),),
    (("kivi_ops.cache",),),
    (("kivi_ops.calibration",),),
    (("kivi_ops",),),
)
# Import edges allowed to close a cycle, each with its reason. None today; an entry here needs one.
CYCLE_EXCEPTIONS: dict[tuple[str, str], str] = {}


def project_modules() -> dict[str, Path]:
    modules = {}
    for package, folder in PACKAGES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join((package, *parts))] = path
    return modules


def _is_package(name: str, modules: dict[str, Path]) -> bool:
    return modules[name].name == "__init__.py"


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The project modules `name` imports, anywhere in its source."""
    package = name if _is_package(name, modules) else name.rpartition(".")[0]
    found = set()

    def add(target: str) -> None:
        # The most specific project module named by a dotted path (a.b.c -> a.b.c, else a.b, else a).
        parts = target.split(".")
        for end in range(len(parts), 0, -1):
            candidate = ".".join(parts[:end])
            if candidate in modules:
                found.add(candidate)
                return

    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([node.module] if node.module else []))
            else:
                base = node.module
            for alias in node.names:
                add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base)
    found.discard(name)
    return found


def import_graph() -> dict[str, set[str]]:
    modules = project_modules()
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as [a, b, ..., a], or None (iterative depth-first search)."""
    WHITE, GREY, BLACK = 0, 1, 2
    color = dict.fromkeys(graph, WHITE)
    for root in sorted(graph):
        if color[root] != WHITE:
            continue
        stack, path = [(root, iter(sorted(graph[root])))], [root]
        color[root] = GREY
        while stack:
            node, children = stack[-1]
            child = next(children, None)
            if child is None:
                color[node] = BLACK
                stack.pop()
                path.pop()
            elif color[child] == GREY:
                return path[path.index(child):] + [child]
            elif color[child] == WHITE:
                color[child] = GREY
                stack.append((child, iter(sorted(graph[child]))))
                path.append(child)
    return None


def test_the_graph_sees_the_projects_imports():
    # The parser is right about a few known edges (module-level, relative, function-level, package).
    graph = import_graph()
    assert "kivi_ops.kernels.reference.packing" in graph["kivi_ops.calibration.nuq"]  # from ..kernels.reference.packing import ...
    assert "kivi_ops.ops" in graph["kivi_ops.ops.quantized"]  # from .. import ops
    assert "kivi_ops" in graph["kivi_models.generate"]  # from kivi_ops import KIVICache
    assert "kivi_export.exporter" in graph["kivi_cli.export"]  # inside cmd_export
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycles():
    graph = import_graph()
    for (importer, imported), reason in CYCLE_EXCEPTIONS.items():
        assert reason and imported in graph[importer], f"stale exception {importer} -> {imported}"
        graph[importer].discard(imported)
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_layers_import_downward():
    graph = import_graph()
    for name, imported in graph.items():
        packages = {target.partition(".")[0] for target in imported}
        assert packages <= ALLOWED[name.partition(".")[0]], (name, imported)
    assert [name for name, imported in graph.items() if ENTRY in imported] == [RUNNER]


def floor_of(module: str) -> tuple[int, int] | None:
    """(floor, group) of a kivi_ops module: its longest prefix in FLOORS; None if it has none."""
    best, length = None, -1
    for floor, groups in enumerate(FLOORS):
        for group, prefixes in enumerate(groups):
            for prefix in prefixes:
                matches = module == prefix or (prefix != "kivi_ops" and module.startswith(prefix + "."))
                if matches and len(prefix) > length:
                    best, length = (floor, group), len(prefix)
    return best


def upward_imports(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """The kivi_ops edges that run up a floor or across to a sibling group."""
    bad = []
    for name, imported in graph.items():
        if name.partition(".")[0] != "kivi_ops":
            continue
        here = floor_of(name)
        for target in sorted(imported):
            there = floor_of(target) if target.partition(".")[0] == "kivi_ops" else None
            if there is not None and not (there[0] < here[0] or there == here):
                bad.append((name, target))
    return bad


def test_every_kivi_ops_module_has_a_floor():
    assert not [name for name in import_graph() if name.partition(".")[0] == "kivi_ops" and floor_of(name) is None]


def test_kivi_ops_imports_run_down_its_floors():
    # The rule catches an edge up, one across the kernel families, and lets one down and one within a group pass.
    assert upward_imports({"kivi_ops.options.pool": {"kivi_ops.cache.layer"},
                           "kivi_ops.kernels.triton.append": {"kivi_ops.kernels.cuda.attend"},
                           "kivi_ops.cache.paged": {"kivi_ops.ops.paged", "kivi_ops.cache.static"},
                           "kivi_ops.config": {"kivi_ops.options.rotation"}}) == [
        ("kivi_ops.options.pool", "kivi_ops.cache.layer"),
        ("kivi_ops.kernels.triton.append", "kivi_ops.kernels.cuda.attend")]
    assert upward_imports(import_graph()) == []


def package_graph() -> dict[str, set[str]]:
    """Package -> the other packages its modules import."""
    graph: dict[str, set[str]] = {package: set() for package in PACKAGES}
    for name, imported in import_graph().items():
        package = name.partition(".")[0]
        graph[package] |= {target.partition(".")[0] for target in imported} - {package}
    return graph


def test_no_package_imports_one_that_imports_it_back():
    graph = package_graph()
    assert graph["kivi_cli"] == set(PACKAGES) - {"kivi_cli"}
    cycle = find_cycle(graph)
    assert cycle is None, "package cycle: " + " -> ".join(cycle)


def test_the_product_never_imports_the_lab():
    # lab/ (candidate kernels, one-off studies) is not installed: an import of it would fail for users.
    for package, folder in PACKAGES.items():
        for path in (ROOT / folder).rglob("*.py"):
            tree = ast.parse(path.read_text(), filename=str(path))
            for node in ast.walk(tree):
                names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                         else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
                assert not any(n == "lab" or n.startswith("lab.") for n in names), path


def test_only_the_entry_point_imports_command_modules():
    # Subcommands are registered in one place; the shared helpers import no command module.
    graph = import_graph()
    commands = {name for name in graph if name.startswith("kivi_cli.") and name not in (CLI_HELPERS, RUNNER)}
    assert {"kivi_cli.generate", "kivi_cli.serve", "kivi_cli.export", "kivi_cli.evaluate", ENTRY} <= commands
    # No command module lives outside cli/ (a *_cli.py or cli.py would be one).
    assert not [name for name in graph if not name.startswith("kivi_cli") and name.rpartition(".")[2].endswith("cli")]
    for name, imported in graph.items():
        if name not in (ENTRY, RUNNER):
            assert not imported & commands, (name, imported & commands)
    assert commands - {ENTRY} <= graph[ENTRY]  # ... and the entry point registers every one


CACHE_BUFFERS = {"k_codes", "k_scale", "k_zero", "k_res", "v_codes", "v_scale", "v_zero", "v_res", "pool_k", "pool_v",
                 "pool_pos", "k_sparse", "k_sparse_idx", "v_sparse", "v_sparse_idx", "k_levels", "v_levels",
                 "rope_inv_freq"}


def test_only_kivi_ops_names_a_cache_buffer():
    # The layer owns its buffers: code outside kivi_ops reaches them through the layer's methods
    # (append, attend, nbytes, reset, ...) and kivi_ops helpers, never by attribute or by name.
    for package, folder in PACKAGES.items():
        if package == "kivi_ops":
            continue
        for path in (ROOT / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
                named = (node.attr if isinstance(node, ast.Attribute)
                         else node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None)
                assert named not in CACHE_BUFFERS, f"{path.relative_to(ROOT)}:{node.lineno} names {named!r}"


def test_no_two_classes_share_a_name():
    """A class name says one thing in the whole project (the lab included): two `Plan`s or two
    `Paging`s make a reader check which one an import means."""
    where: dict[str, list[str]] = {}
    lab = {f"lab.{p.stem}": p for p in sorted((ROOT / "lab").rglob("*.py"))}
    for name, path in {**project_modules(), **lab}.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                where.setdefault(node.name, []).append(name)
    shared = {cls: modules for cls, modules in where.items() if len(modules) > 1}
    assert not shared, shared


def test_the_design_docs_map_names_every_file():
    # docs/design.md's "Where things live" says what each file is for: a file added without a line
    # there fails here. Each file is looked up in its package's section of the map.
    text = (ROOT / "docs/design.md").read_text()
    start = text.index("## Where things live")
    block = text[start:text.index("```\n", text.index("```\n", start) + 4)]
    sections, folder = {}, None
    for line in block.splitlines():
        if line[:1].isalpha() and "/" in line.split()[0]:
            folder = line.split()[0].rstrip("/")
        if folder:
            sections[folder] = sections.get(folder, "") + line + "\n"
    missing = []
    for folder in PACKAGES.values():
        for path in sorted((ROOT / folder).rglob("*")):
            if (path.suffix in {".py", ".cu", ".h", ".cpp", ".json"} and path.name != "__init__.py"
                    and "results" not in path.parts and path.name not in sections.get(folder, "")):
                missing.append(str(path.relative_to(ROOT)))
    assert not missing, f"docs/design.md's map does not name: {missing}"
