"""Without CUDA, Triton kernels run in the interpreter; it must be enabled before any kernel module
is imported, whichever test module imports one first. The CPU kernel selection (below) likewise.

Under pytest-xdist (`make test`: two workers), each worker takes its share of the cores for
torch's intra-op threads: by default every worker would start one thread per core, and on two
cores four spinning OpenMP threads slowed torch-heavy tests several times over (a perplexity test:
24 s alone, 130 s in the suite)."""

import os
import re
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The suite runs the reference CPU kernels: the default compiled ones (kernels/cpu_compiled.py)
# compile once per cache shape, seconds each, and the suite builds hundreds of shapes. The
# compiled-mode forms themselves are tested in test_decomposed.py and test_cache_property.py, and
# test_cpu_compiled.py runs the default selection as users get it.
os.environ.setdefault("KIVI_CPU_KERNELS", "reference")

_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _workers > 1:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // _workers))


_MODULE_FIXTURE = re.compile(r"""scope=["'](module|class|package)["']""")


@pytest.hookimpl(optionalhook=True)  # an xdist hook: `pytest -p no:xdist` must still load this file
def pytest_xdist_make_scheduler(config, log):
    """`make test` runs `--dist loadscope` with its scopes refined: the tests of a file that defines a
    module-scoped fixture (a loaded model, an export, a server) stay on one worker, so the fixture is
    built once; every other test is its own unit of work, spread over the workers. Under
    `--dist loadfile` one long file of independent kernel tests (test_triton_kernels.py) kept one
    worker busy while the other had finished. (xdist's own `loadgroup` marks cannot do this under
    pytest 9: xdist 3.8 renames `item._nodeid`, which pytest 9 no longer reads.)"""
    if config.getvalue("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    root = Path(config.rootpath)
    shared: dict[str, bool] = {}

    class ModuleFixtureScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            if path not in shared:
                file = root / path
                shared[path] = file.is_file() and bool(_MODULE_FIXTURE.search(file.read_text()))
            return path if shared[path] else nodeid

    return ModuleFixtureScheduling(config, log)
