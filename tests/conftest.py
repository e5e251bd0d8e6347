"""Without CUDA, Triton kernels run in the interpreter; it must be enabled before any kernel module
is imported, whichever test module imports one first. The CPU kernel selection (below) likewise.

Under pytest-xdist (`make test`: two workers), each worker takes its share of the cores for
torch's intra-op threads: by default every worker would start one thread per core, and on two
cores four spinning OpenMP threads slowed torch-heavy tests several times over (a perplexity test:
24 s alone, 130 s in the suite)."""

import os

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


def pytest_collection_modifyitems(config, items):
    """`make test` distributes with `--dist loadgroup`: a test that uses a module-scoped fixture (a
    loaded model, an export) stays on one worker with the rest of its module, so the fixture is built
    once; every other test is distributed on its own. Under `--dist loadfile` one long file of
    independent kernel tests (test_triton_kernels.py) ran on one worker while the other sat idle."""
    import pytest

    for item in items:
        fixture_defs = getattr(item, "_fixtureinfo", None)
        scopes = {d.scope for defs in (fixture_defs.name2fixturedefs.values() if fixture_defs else ())
                  for d in defs}
        if "module" in scopes or "class" in scopes or "package" in scopes:
            item.add_marker(pytest.mark.xdist_group(item.module.__name__))
