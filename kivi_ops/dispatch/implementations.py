"""The implementation table: each cache-op implementation's name mapped to its static and paged
function. A plain dict, not functools.cache (Dynamo warns on every lru_cache call it traces), so a
form is the same object on every call (cpu_compiled.py keys by it); device kernels load lazily."""

from __future__ import annotations

import functools
from typing import Callable, NamedTuple

from ..kernels.decomposed.append import append_decomposed
from ..kernels.decomposed.attend import attend_fused, attend_materialized
from ..kernels.reference import append_reference, attend_reference, paged_append_reference, paged_attend_reference
from ..paged_layout import indexed_view, static_view

OPS = ("append", "attend")
APPEND = ("reference", "decomposed", "decomposed_cond", "triton")
ATTEND = ("reference", "decomposed_fused", "decomposed_materialized", "triton_decode", "triton_split", "cuda_cpp")
IMPLEMENTATIONS = ("reference", "decomposed", "decomposed_cond", "decomposed_fused", "decomposed_materialized", "triton",
                   "triton_decode", "triton_split", "cuda_cpp")


class Forms(NamedTuple):
    static: Callable
    paged: Callable


def _append_decomposed(flush_under_cond, layer, key, value, counts, params, pages):
    append_decomposed(layer, key, value, counts, params, flush_under_cond=flush_under_cond, pages=pages)


# The fused form inlines the block-table indexing; the materialized form's matmuls need contiguous copies.
def _attend_indexed(query, layer, counts, params, scale, pages):
    return attend_fused(query, indexed_view(layer, pages.block_table), counts, params, scale)


def _attend_gathered(query, layer, counts, params, scale, pages):
    return attend_materialized(query, static_view(layer, pages.block_table), counts, params, scale)


def _with_pages(fn):
    def paged(*args, **launch):
        return fn(*args[:-1], pages=args[-1], **launch)
    paged.__name__ = f"paged_{fn.__name__}"
    return paged


def _triton_append() -> Forms:
    from ..kernels.triton.append import append_triton

    return Forms(append_triton, _with_pages(append_triton))


def _triton_decode() -> Forms:
    from ..kernels.triton.decode import attend_decode

    return Forms(attend_decode, _with_pages(attend_decode))


def _triton_split() -> Forms:
    from ..kernels.triton.split import attend_split

    return Forms(attend_split, _with_pages(attend_split))


def _cuda_cpp() -> Forms:
    from ..kernels.cuda.attend import attend_cuda_cpp, attend_cuda_cpp_paged

    return Forms(attend_cuda_cpp, attend_cuda_cpp_paged)


_TABLE: dict[str, dict[str, Forms]] = {
    "append": {
        "reference": Forms(append_reference, paged_append_reference),
        "decomposed": Forms(functools.partial(append_decomposed, flush_under_cond=False),
                            functools.partial(_append_decomposed, False)),
        "decomposed_cond": Forms(functools.partial(append_decomposed, flush_under_cond=True),
                                 functools.partial(_append_decomposed, True)),
    },
    "attend": {
        "reference": Forms(attend_reference, paged_attend_reference),
        "decomposed_fused": Forms(attend_fused, _attend_indexed),
        "decomposed_materialized": Forms(attend_materialized, _attend_gathered),
    },
}
_DEVICE_KERNELS = {("append", "triton"): _triton_append, ("attend", "triton_decode"): _triton_decode,
                   ("attend", "triton_split"): _triton_split, ("attend", "cuda_cpp"): _cuda_cpp}


def form(op: str, implementation: str, paged: bool = False) -> Callable:
    """The function of one implementation of `op`, the same object on every call."""
    forms = _TABLE[op].get(implementation)
    if forms is None:
        load = _DEVICE_KERNELS.get((op, implementation))
        if load is None:
            raise ValueError(f"no {op} implementation {implementation!r}; the {op} implementations are "
                             f"{APPEND if op == 'append' else ATTEND}")
        forms = _TABLE[op][implementation] = load()
    return forms.paged if paged else forms.static


def index(implementation: str) -> int:
    return IMPLEMENTATIONS.index(implementation)


def name(op: str, implementation: int) -> str:
    names = APPEND if op == "append" else ATTEND
    found = IMPLEMENTATIONS[implementation] if 0 <= implementation < len(IMPLEMENTATIONS) else None
    if found not in names:
        allowed = ", ".join(f"{index(n)} ({n})" for n in names)
        raise ValueError(f"implementation must be one of the {op} implementations, {allowed}; got {implementation}")
    return found


def run_append(implementation: str, layer, key, value, counts, params, *, pages=None) -> None:
    extra = () if pages is None else (pages,)
    form("append", implementation, pages is not None)(layer, key, value, counts, params, *extra)


def run_attend(implementation: str, query, layer, counts, params, scale: float, *, pages=None, launch: tuple = ()):
    extra = () if pages is None else (pages,)
    return form("attend", implementation, pages is not None)(query, layer, counts, params, scale, *extra,
                                                             **dict(launch))
