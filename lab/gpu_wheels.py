"""The wheels the GPU image lacks, for lab/gpu_suite.sh: exactly the dependency closure of what the
suite runs, minus the image's preinstalled packages (lab/gpu_image_packages.txt).

    python -m lab gpu_wheels [--dest .whl] [--list] [--check]

The lent GPU machine reaches no package index, so every module the suite imports must either be in
the image or travel as a wheel in .whl/ (the suite installs them with `pip install --no-deps`). The
2026-11-27 H200 run lost its CLI stages to one missing module: fastapi 0.165 imports `opentelemetry`
(opentelemetry-api), which a hand-made wheel list had left out. So the list is computed, not written:

- roots: the project's runtime dependencies (kivi-ops's metadata, i.e. pyproject.toml), and the
  test-time packages the suite's command lines use (SUITE_TEST_PACKAGES);
- each requirement's marker is evaluated for the GPU machine's Python (3.12, Linux x86_64);
- a package the image has is taken from the image (torch, Triton and transformers cannot travel:
  their wheels are far over what a call carries), and its own requirements with it;
- any other package is needed at the version installed here (the project pins exact versions, and
  this virtualenv holds them), and its requirements, with the extras asked for, are followed.

All of that reads installed metadata only, so it runs offline (tests/test_gpu_wheels.py). Then
`pip download` fetches the set for the GPU's platform into --dest, whose other wheels are removed
(two versions of one package stop the suite's install), and the tree a device call carries is
checked against its 64 MiB limit. --check installs the set into a clean target and imports what
the suite runs there, over only the image's packages (check_suite_imports).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename

REPO = Path(__file__).resolve().parent.parent
IMAGE_PACKAGES = Path(__file__).with_name("gpu_image_packages.txt")
SUITE = Path(__file__).with_name("gpu_suite.sh")
PROJECT = "kivi-ops"
# What the suite's pytest command lines load beyond the project's runtime dependencies: pytest and
# the plugins its flags need (-n: xdist, --timeout: pytest-timeout), and httpx (test_gpu_deploy's
# client). The rest of the dev extra (openai, hypothesis) no suite test file imports.
SUITE_TEST_PACKAGES = ("pytest", "pytest-xdist", "pytest-timeout", "httpx")
# The GPU machine's python3 (device docs, KINDS.md): the environment requirement markers see there.
TARGET_MARKER_ENV = {
    "python_version": "3.12", "python_full_version": "3.12.3", "implementation_name": "cpython",
    "implementation_version": "3.12.3", "platform_python_implementation": "CPython", "os_name": "posix",
    "sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64",
    "platform_release": "", "platform_version": "",
}
# The pip download form of the device README: pip matches a manylinux tag's glibc version exactly,
# so every tag the machine accepts is named.
PIP_PLATFORM_ARGS = ["--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp"] + [
    arg for tag in ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64",
                    "manylinux2014_x86_64", "manylinux1_x86_64") for arg in ("--platform", tag)]
# What one device call may carry: the working tree (tracked and untracked-not-ignored files) plus
# the carried paths (device README, Limits).
CARRY_LIMIT_BYTES = 64 * 2**20
CARRIED = (".whl", ".gpu")


def read_image_packages(path: Path = IMAGE_PACKAGES) -> dict[str, str | None]:
    """{canonical name: version or None} from the committed image list."""
    packages = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            packages[canonicalize_name(name)] = version or None
    return packages


def suite_roots() -> list[Requirement]:
    roots = [Requirement(text) for text in importlib.metadata.requires(PROJECT) or []]
    roots = [r for r in roots if r.marker is None or r.marker.evaluate(dict(TARGET_MARKER_ENV, extra=""))]
    return roots + [Requirement(name) for name in SUITE_TEST_PACKAGES]


def _applies(req: Requirement, extras: set[str]) -> bool:
    """Whether `req` (of a package installed with `extras`) is needed on the GPU machine."""
    if req.marker is None:
        return True
    return any(req.marker.evaluate(dict(TARGET_MARKER_ENV, extra=extra)) for extra in extras | {""})


def closure(roots: list[Requirement], image: dict[str, str | None],
            distribution=importlib.metadata.distribution) -> tuple[dict[str, str], list[str]]:
    """({canonical name: version} of the packages the image lacks, notes on image versions that
    differ from what a requirement asks). `distribution(name)` gives a package's installed
    metadata (a parameter so that tests can feed made-up packages)."""
    needed: dict[str, str] = {}
    extras_seen: dict[str, set[str]] = {}
    notes = []
    queue = [(req, PROJECT) for req in roots]
    while queue:
        req, parent = queue.pop(0)
        name = canonicalize_name(req.name)
        if name in image:
            version = image[name]
            if version and not req.specifier.contains(version, prereleases=True):
                notes.append(f"{name}: the image's {version} is taken although {parent} asks {req.specifier}")
            continue
        extras = {canonicalize_name(e) for e in req.extras}
        if name in needed:
            if not req.specifier.contains(needed[name], prereleases=True):
                raise SystemExit(f"gpu_wheels: {parent} needs {req}, but {name} {needed[name]} is installed here")
            if extras <= extras_seen[name]:
                continue
            extras -= extras_seen[name]
        try:
            dist = distribution(req.name)
        except importlib.metadata.PackageNotFoundError:
            raise SystemExit(f"gpu_wheels: {req.name} (needed by {parent} on the GPU machine) is not installed "
                             f"here, so its version and requirements are unknown; install the project with its "
                             f"dev extra (`make setup`) and run again") from None
        if not req.specifier.contains(dist.version, prereleases=True):
            raise SystemExit(f"gpu_wheels: {parent} needs {req}, but {name} {dist.version} is installed here")
        needed[name] = dist.version
        extras_seen[name] = extras_seen.get(name, set()) | extras
        for text in dist.requires or []:
            sub = Requirement(text)
            if _applies(sub, extras_seen[name]):
                queue.append((sub, f"{name} {dist.version}"))
    return dict(sorted(needed.items())), notes


def wheels_in(directory: Path) -> dict[str, tuple[str, Path]]:
    """{canonical name: (version, file)} of the wheels in `directory`."""
    found = {}
    for path in sorted(directory.glob("*.whl")):
        name, version, _, _ = parse_wheel_filename(path.name)
        if name in found:
            raise SystemExit(f"gpu_wheels: {directory} holds two wheels of {name}: {found[name][1].name}, {path.name}")
        found[name] = (str(version), path)
    return found


def download(needed: dict[str, str], dest: Path) -> None:
    """Leave exactly the wheels of `needed` in `dest`: remove the others, fetch the missing."""
    dest.mkdir(parents=True, exist_ok=True)
    for name, (version, path) in wheels_in(dest).items():
        if needed.get(name) != version:
            print(f"removing {path.name} (not in the set)")
            path.unlink()
    have = wheels_in(dest)
    missing = [f"{name}=={version}" for name, version in needed.items() if name not in have]
    if missing:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", *PIP_PLATFORM_ARGS,
                        "-d", str(dest), *missing], check=True)
    have = wheels_in(dest)
    wrong = {name: have.get(name, ("none",))[0] for name, version in needed.items()
             if have.get(name, (None,))[0] != version} | {name: "extra" for name in set(have) - set(needed)}
    if wrong:
        raise SystemExit(f"gpu_wheels: {dest} does not match the set after the download: {wrong}")


def carried_bytes(repo: Path = REPO, carried: tuple[str, ...] = CARRIED) -> int:
    """The bytes a device call sends: the files git would not ignore, plus the carried folders."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                            cwd=repo, capture_output=True, check=True).stdout.decode().split("\0")
    files = {repo / name for name in listed if name}
    for folder in carried:
        files.update(path for path in (repo / folder).rglob("*") if path.is_file())
    return sum(path.stat().st_size for path in files if path.is_file() and not path.is_symlink())


# ------------------------------------------------------------------ the import check (--check, tests)

def suite_modules(suite: Path = SUITE) -> tuple[list[str], list[str]]:
    """(test files, modules) that lab/gpu_suite.sh runs, read from its command lines: every
    tests/*.py it names, `python3 -m kivi_cli` and each `python3 -m lab NAME` study."""
    text = suite.read_text()
    tests = sorted(set(re.findall(r"\btests/test_\w+\.py\b", text)))
    modules = ["kivi_cli.main"] if re.search(r"-m kivi_cli\b", text) else []
    modules += sorted({f"lab.{name}" for name in re.findall(r"-m lab (\w+)", text)})
    return tests, modules


def _project_packages(repo: Path) -> dict[str, Path]:
    """{import name: source folder} of the project's installed packages (pyproject's package-dir)."""
    import tomllib

    config = tomllib.loads((repo / "pyproject.toml").read_text())["tool"]["setuptools"]
    return {name: repo / folder for name, folder in config["package-dir"].items()}


def installed(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _link(source: Path, link: Path) -> None:
    if link.exists() or link.is_symlink():
        return
    link.symlink_to(source)


def mirror_site(names, site: Path, repo: Path = REPO) -> list[str]:
    """Link into `site` what this Python has of the packages `names` (their top-level modules and
    their .dist-info, for entry points such as pytest's plugins), and the project's own packages:
    a stand-in for the GPU image's site-packages. Returns the names this Python lacks."""
    site.mkdir(parents=True, exist_ok=True)
    absent = []
    for name in names:
        try:
            dist = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            absent.append(name)
            continue
        tops = {Path(f).parts[0] for f in dist.files or [] if not str(f).startswith("..")}
        for top in tops:
            source = Path(dist.locate_file(top))
            if top.endswith(".dist-info") or not source.is_dir() or (source / "__init__.py").exists():
                _link(source, site / top)
                continue
            # a namespace folder (nvidia/, google/) that other, non-image packages share: link only
            # this package's part of it
            (site / top).mkdir(exist_ok=True)
            for f in dist.files:
                if Path(f).parts[0] == top and len(Path(f).parts) > 2:
                    _link(Path(dist.locate_file(Path(*Path(f).parts[:2]))), site / top / Path(f).parts[1])
    for name, folder in _project_packages(repo).items():
        _link(folder, site / name)
    return absent


def image_support(image: dict[str, str | None], exclude: set[str]) -> list[str]:
    """The packages this Python's copies of the image's packages need besides the image's list:
    the image's own (older) versions bring what they need (huggingface_hub 1.33 there; here a
    newer one imports httpx2). Packages of `exclude` (the computed wheel set) are never among them,
    so that they come from the wheels alone."""
    found, queue = [], list(image)
    while queue:
        try:
            requires = importlib.metadata.requires(queue.pop()) or []
        except importlib.metadata.PackageNotFoundError:
            continue
        for text in requires:
            req = Requirement(text)
            name = canonicalize_name(req.name)
            if (req.marker is None or req.marker.evaluate({"extra": ""})) and installed(name) \
                    and name not in image and name not in exclude and name not in found:
                found.append(name)
                queue.append(name)
    return found


def split_installable(wheels: list[Path]) -> tuple[list[Path], dict[str, str]]:
    """(the wheels this Python can install, {name: version} of the others). The set is built for
    the GPU's CPython 3.12; a compiled wheel of another Python (pydantic-core) cannot install here,
    so the check stands in this Python's installed copy of the same name and version for it: what
    is tested is which packages the set holds."""
    from packaging.tags import sys_tags

    supported = set(sys_tags())
    installable, others = [], {}
    for path in wheels:
        name, version, _, tags = parse_wheel_filename(path.name)
        if tags & supported:
            installable.append(path)
        else:
            others[name] = str(version)
    return installable, others


IMPORT_CHECK = """
import importlib, sys
failed = 0
for module in sys.argv[1:]:
    try:
        importlib.import_module(module)
    except ImportError as e:
        failed += 1
        print(f"MISSING {e.name or e} (importing {module}): {e}")
sys.exit(1 if failed else 0)
"""


def check_suite_imports(wheels: Path, image: dict[str, str | None], repo: Path = REPO,
                        suite: Path = SUITE) -> list[str]:
    """Install `wheels` with the suite's own pip command into a clean target, over a stand-in for
    the image's site-packages, with this virtualenv's site-packages off the path (python -S); then
    import the modules the suite runs and collect its test files (split_installable: a compiled
    wheel for the GPU's Python stands in as this Python's copy). Returns the problems, each naming
    the missing module ([] when all import)."""
    tests, modules = suite_modules(suite)
    # a study the suite names but the repository lacks is no wheel's doing: tests check it apart
    modules = [m for m in modules if not m.startswith("lab.") or (repo / "lab" / f"{m[4:]}.py").is_file()]
    with tempfile.TemporaryDirectory(prefix="gpu_wheels_") as tmp:
        target, site = Path(tmp) / "site", Path(tmp) / "image"
        installable, stand_ins = split_installable(sorted(wheels.glob("*.whl")))
        if installable:
            subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                            "--no-cache-dir", "--target", str(target), *map(str, installable)], check=True)
        problems = [f"the set's {name} {version} has no stand-in here ({name} {installed(name)} is installed)"
                    for name, version in stand_ins.items() if installed(name) != version]
        needed, _ = closure(suite_roots(), image)
        mirror_site(list(image) + image_support(image, set(needed)) + list(stand_ins), site, repo)
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
        env.update(PYTHONPATH=f"{target}{os.pathsep}{site}", PYTHONNOUSERSITE="1", TRITON_INTERPRET="1")
        run = subprocess.run([sys.executable, "-S", "-c", IMPORT_CHECK, *modules], cwd=repo, env=env,
                             capture_output=True, text=True)
        problems += [line for line in run.stdout.splitlines() if line.startswith("MISSING")]
        if run.returncode and not problems:
            problems.append(f"importing {modules} failed: {run.stderr[-2000:]}")
        # collection imports every test module: a missing module fails it with its name
        run = subprocess.run([sys.executable, "-S", "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                              *tests], cwd=repo, env=env, capture_output=True, text=True)
        if run.returncode:
            named = sorted(set(re.findall(r"No module named '([\w.]+)'", run.stdout + run.stderr)))
            problems += [f"MISSING {name} (collecting the suite's tests)" for name in named] or [
                f"collecting {tests} failed: {(run.stdout + run.stderr)[-2000:]}"]
        return problems


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m lab gpu_wheels", description=__doc__.split("\n\n")[0])
    parser.add_argument("--dest", type=Path, default=REPO / ".whl", help="the wheel folder (default .whl)")
    parser.add_argument("--list", action="store_true", help="print the set and exit (offline)")
    parser.add_argument("--check", action="store_true", help="then install the set into a clean target and "
                        "import what the suite runs there, over only the image's packages")
    args = parser.parse_args(argv)
    image = read_image_packages()
    needed, notes = closure(suite_roots(), image)
    for note in notes:
        print(f"note: {note}")
    print(f"{len(needed)} packages the GPU image lacks: " + " ".join(f"{n}=={v}" for n, v in needed.items()))
    if args.list:
        return
    download(needed, args.dest)
    size = carried_bytes()
    wheel_bytes = sum(p.stat().st_size for p in args.dest.glob("*.whl"))
    print(f"{args.dest}: {wheel_bytes / 2**20:.1f} MiB of wheels; a device call carries {size / 2**20:.1f} MiB "
          f"(working tree + {', '.join(CARRIED)}; limit {CARRY_LIMIT_BYTES / 2**20:.0f} MiB)")
    if size > CARRY_LIMIT_BYTES:
        raise SystemExit(f"gpu_wheels: a device call would carry {size / 2**20:.1f} MiB, over the "
                         f"{CARRY_LIMIT_BYTES / 2**20:.0f} MiB limit: cut the test model (`python -m lab gguf_truncate "
                         f"--blocks ...`) or the wheels")
    if args.check:
        problems = check_suite_imports(args.dest, image)
        print("\n".join(problems) or "every module the suite runs imports over the image's packages + these wheels")
        if problems:
            raise SystemExit(1)
