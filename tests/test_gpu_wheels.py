"""lab/gpu_wheels.py: the wheels the GPU image lacks are computed (the dependency closure of what
lab/gpu_suite.sh runs, minus the image's list), and with them every module the suite runs imports
over the image's packages alone. The 2026-11-27 H200 run lost its CLI to one missing wheel
(opentelemetry-api, which fastapi 0.165 imports)."""

from __future__ import annotations

import importlib.metadata
import shutil
import subprocess
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from lab import gpu_wheels

IMAGE = gpu_wheels.read_image_packages()


@pytest.fixture(scope="module")
def wheel_set():
    needed, _ = gpu_wheels.closure(gpu_wheels.suite_roots(), IMAGE)
    return needed


def test_the_image_list_is_the_device_docs_list():
    # the big three come from the image, at the versions the docs' pip list gives
    assert IMAGE["torch"] == "2.11.0" and IMAGE["triton"] == "3.6.0" and IMAGE["transformers"] == "5.17.0"
    assert {"pytest", "pytest-xdist", "pytest-timeout", "httpx", "anyio", "annotated-doc"} <= set(IMAGE)
    assert "fastapi" not in IMAGE and "opentelemetry-api" not in IMAGE


def test_the_set_is_the_closure_minus_the_image(wheel_set):
    # what the last run carried by hand, less annotated-doc (the image has it), plus opentelemetry-api
    assert set(wheel_set) == {"annotated-types", "fastapi", "gguf", "opentelemetry-api", "pydantic", "pydantic-core",
                              "starlette", "torchao", "typing-inspection", "uvicorn"}
    assert not set(wheel_set) & set(IMAGE)
    # at the versions installed here (the project's pins)
    assert wheel_set["fastapi"] == importlib.metadata.version("fastapi") == "0.165.0"


class FakeDist:
    def __init__(self, version, requires):
        self.version, self.requires = version, requires


def test_markers_are_evaluated_for_the_gpu_python_and_extras_only_when_asked():
    dists = {
        "app": FakeDist("1.0", ['old-backport; python_version < "3.11"', 'win-only; sys_platform == "win32"',
                                'new-thing>=2; python_version >= "3.12"', 'plugin; extra == "full"', "lib[fast]",
                                "torch>=2.13"]),
        "new-thing": FakeDist("2.1", []),
        "lib": FakeDist("0.3", ['speedup; extra == "fast"', 'docs; extra == "docs"']),
        "speedup": FakeDist("1.1", []),
    }

    def distribution(name):
        if name not in dists:
            raise importlib.metadata.PackageNotFoundError(name)
        return dists[name]

    needed, notes = gpu_wheels.closure([Requirement("app")], {"torch": "2.11.0"}, distribution)
    assert needed == {"app": "1.0", "lib": "0.3", "new-thing": "2.1", "speedup": "1.1"}
    assert notes == ["torch: the image's 2.11.0 is taken although app 1.0 asks >=2.13"]

    # a needed package missing here: named, with what needs it
    dists["app"].requires.append("absent-pkg")
    with pytest.raises(SystemExit, match="absent-pkg .needed by app 1.0"):
        gpu_wheels.closure([Requirement("app")], {"torch": "2.11.0"}, distribution)


def test_the_suite_names_every_cuda_test_file_and_its_studies():
    tests, modules = gpu_wheels.suite_modules()
    assert {"tests/test_paged_gpu.py", "tests/test_gpu.py", "tests/test_gpu_deploy.py",
            "tests/test_cuda_cpp_kernel.py", "tests/test_triton_kernels.py"} <= set(tests)
    assert "kivi_cli.main" in modules and "lab.gpu_attend_sweep" in modules


def test_the_carried_bytes_count_what_travels_once(tmp_path):
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    (tmp_path / ".gitignore").write_text("/.whl/\nignored.bin\n")                # 19 bytes
    (tmp_path / "tracked.py").write_bytes(b"x" * 100)
    (tmp_path / "ignored.bin").write_bytes(b"x" * 10_000)                       # stays behind
    (tmp_path / ".whl").mkdir()
    (tmp_path / ".whl" / "a.whl").write_bytes(b"x" * 1000)                      # ignored, but carried
    (tmp_path / ".gpu").mkdir()
    (tmp_path / ".gpu" / "model.gguf").write_bytes(b"x" * 500)                  # untracked and carried: once
    subprocess.run(["git", "add", "tracked.py", ".gitignore"], cwd=tmp_path, check=True)
    assert gpu_wheels.carried_bytes(tmp_path) == 19 + 100 + 1000 + 500


# test files that ask for CUDA but test nothing on it
NOT_GPU_TESTS = {"conftest.py": "sets up the Triton interpreter where CUDA is absent",
                 "test_model.py": "checks only the CLI's message when CUDA is absent",
                 "test_gpu_wheels.py": "names it only in this check",
                 "test_tuning.py": "checks only gpu_tune's refusal where CUDA is absent (the dispatch tests fake a GPU)"}


def test_the_suite_runs_every_test_file_that_uses_cuda():
    tests, _ = gpu_wheels.suite_modules()
    uses_cuda = {f"tests/{p.name}" for p in Path(gpu_wheels.REPO, "tests").glob("*.py")
                 if "cuda.is_available()" in p.read_text() and p.name not in NOT_GPU_TESTS}
    assert uses_cuda - set(tests) == set()


def test_every_study_the_suite_runs_exists():
    _, modules = gpu_wheels.suite_modules()
    absent = [m for m in modules if m.startswith("lab.") and not Path(gpu_wheels.REPO, "lab", m[4:] + ".py").is_file()]
    if absent == ["lab.gpu_tune"]:
        pytest.xfail("lab/gpu_tune.py (the tune stage) comes with the tuning table's branch")
    assert absent == []


@pytest.fixture(scope="module")
def downloaded(wheel_set):
    # pip download fetches only what the cache folder lacks, so reruns stay offline
    cache = Path.home() / ".cache" / "kivi" / "gpu-wheels"
    gpu_wheels.download(wheel_set, cache)
    return cache


@pytest.mark.slow
def test_the_set_imports_everything_the_suite_runs_over_the_image(downloaded):
    assert gpu_wheels.check_suite_imports(downloaded, IMAGE) == []


@pytest.mark.slow
def test_the_check_names_the_module_a_set_without_opentelemetry_misses(downloaded, tmp_path):
    for wheel in downloaded.glob("*.whl"):
        if not wheel.name.startswith("opentelemetry_api-"):
            shutil.copy(wheel, tmp_path)
    problems = gpu_wheels.check_suite_imports(tmp_path, IMAGE)
    assert any(p.startswith("MISSING opentelemetry (importing kivi_cli.main)") for p in problems), problems
