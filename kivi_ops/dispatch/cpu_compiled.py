"""CPU decode steps outside torch.compile: the decomposed forms a compiled step would inline, compiled
by Inductor per op, once per signature (docs/design.md, docs/serve.md). At most MAX_SIGNATURES per op
and process (each costs seconds and keeps its code); a later one runs the reference."""

from __future__ import annotations

import functools
import threading
from collections import defaultdict

from . import implementations
from .compile_budget import compile_own_code, signature as _signature
from ..layout import LayerTensors, QuantParams

MAX_SIGNATURES = 8

_signatures: dict = defaultdict(set)


@functools.cache
def _compiled(form, signature: tuple):
    """Own recompile budget per form: most forms are functools.partial objects, which would share one."""
    return compile_own_code(form, fullgraph=True, dynamic=False)


_thread = threading.local()


def stop_compiling_on_this_thread() -> None:
    """On this thread, from now on, a signature not compiled yet runs the reference (a server's warm-up)."""
    _thread.compiles = False


def compiles_on_this_thread() -> bool:
    return getattr(_thread, "compiles", True)


def _within_budget(form, signature: tuple) -> bool:
    seen = _signatures[form]
    if signature not in seen and (len(seen) >= MAX_SIGNATURES or not compiles_on_this_thread()):
        return False
    seen.add(signature)
    return True


def append(form, layer: LayerTensors, key, value, counts, params: QuantParams, pages=None) -> None:
    """Run the append form compiled, or the reference past the budget."""
    extra = () if pages is None else (pages,)
    signature = _signature(layer, key, value, counts, params, *extra)
    if _within_budget(form, signature):
        _compiled(form, signature)(layer, key, value, counts, params, *extra)
    else:
        implementations.run_append("reference", layer, key, value, counts, params, pages=pages)


def attend(form, query, layer: LayerTensors, counts, params: QuantParams, scale: float, pages=None):
    extra = () if pages is None else (pages,)
    signature = _signature(query, layer, counts, params, scale, *extra)
    if _within_budget(form, signature):
        return _compiled(form, signature)(query, layer, counts, params, scale, *extra)
    return implementations.run_attend("reference", query, layer, counts, params, scale, pages=pages)
