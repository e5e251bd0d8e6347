"""CPU decode steps outside torch.compile: the compiled-mode forms, compiled per op.

A decode step that runs eagerly on CPU (transformers' `generate()` with compile disabled, `kivi
eval`, `kivi generate` without --compile) would otherwise run the reference, which is written to
be read: dozens of small ops per call. Here it runs the decomposed form a compiled step would
inline (dispatch.py says which), compiled by Inductor on its own, once per signature (shapes,
dtypes, settings), the way Triton compiles a CUDA kernel on its first launch. The first call of a
signature compiles (a few seconds per op on the 2-core CPU; Inductor's on-disk cache shortens it in
later processes); every later call runs the compiled loops.

Measured (lab/decomposed_attend_cpu.py, the default model's attention at 1K tokens, batch 1, one
thread): attention 1.17 ms (reference) -> 0.29 ms, a one-token append 0.51 -> 0.23 ms.

At most MAX_SIGNATURES signatures per op are compiled in a process: each costs seconds of compile
and keeps its code, and a process that meets ever new shapes (an eval over many batch sizes)
would otherwise compile forever. A later signature runs the reference.

A server compiles before it says it is ready, never while it serves (`kivi serve`, issue 43): its
engine thread runs the shapes it will meet (the decode buckets, a one-token prefill) and then calls
`stop_compiling_on_this_thread()`, after which a signature that thread has not seen runs the
reference instead of compiling (a reference op costs a few times a compiled one; a compile costs
seconds, which would stall every running stream). Other threads are not affected.

Numerics: the appends write the reference's bits (the decomposed append is bit-exact,
tests/test_decomposed.py); the attention sums in another order (fp32 rounding, tests bound it).
`KIVI_CPU_KERNELS=reference` (dispatch.py) selects the reference everywhere.
"""

from __future__ import annotations

import functools
import threading
from collections import defaultdict

from . import implementations
from .compile_budget import compile_own_code, signature as _signature
from ..layout import LayerTensors, QuantParams

MAX_SIGNATURES = 8

# Per form (implementations.form: one object per name), the
# signatures compiled so far.
_signatures: dict = defaultdict(set)


@functools.cache
def _compiled(form, signature: tuple):
    """form compiled for one signature (its own recompile budget: compile_budget.py; most forms
    are functools.partial objects, which would otherwise share one)."""
    return compile_own_code(form, fullgraph=True, dynamic=False)


# Per thread: whether that thread may still compile a new signature (stop_compiling_on_this_thread).
_thread = threading.local()


def stop_compiling_on_this_thread() -> None:
    """From now on, on the calling thread, a signature not compiled yet runs the reference instead
    of compiling (the signatures compiled so far, by any thread, keep running compiled). A serving
    thread calls it once its warm-up has compiled what it will run (see the module doc)."""
    _thread.compiles = False


def compiles_on_this_thread() -> bool:
    """Whether a new signature met on this thread is compiled (False after stop_compiling_on_this_thread)."""
    return getattr(_thread, "compiles", True)


def _within_budget(form, signature: tuple) -> bool:
    seen = _signatures[form]
    if signature not in seen and (len(seen) >= MAX_SIGNATURES or not compiles_on_this_thread()):
        return False
    seen.add(signature)
    return True


def append(form, layer: LayerTensors, key, value, counts, params: QuantParams, pages=None) -> None:
    """Run the append form (a decomposed append) compiled, or the reference past the budget.
    pages: a paged layer's Paging (form is then a paged form, implementations.py)."""
    extra = () if pages is None else (pages,)
    signature = _signature(layer, key, value, counts, params, *extra)
    if _within_budget(form, signature):
        _compiled(form, signature)(layer, key, value, counts, params, *extra)
    else:
        implementations.run_append("reference", layer, key, value, counts, params, pages=pages)


def attend(form, query, layer: LayerTensors, counts, params: QuantParams, scale: float, pages=None):
    """Run the attention form (a decomposed attention) compiled, or the reference past the budget."""
    extra = () if pages is None else (pages,)
    signature = _signature(query, layer, counts, params, scale, *extra)
    if _within_budget(form, signature):
        return _compiled(form, signature)(query, layer, counts, params, scale, *extra)
    return implementations.run_attend("reference", query, layer, counts, params, scale, pages=pages)
