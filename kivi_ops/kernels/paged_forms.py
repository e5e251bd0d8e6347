"""The paged form of each cache-op implementation (dispatch.py names them): the static code with the
block table passed along. Each takes the static form's arguments plus a Paging (paged_layout.py).

    append  reference                     reference.paged_append_reference
            decomposed, decomposed_cond   decomposed_append.append_decomposed(pages=...): rows
                                          written through the block table
            triton                        triton_append.append_triton(pages=...)
    attend  reference                     reference.paged_attend_reference
            decomposed_fused              the static form on paged_layout.indexed_view: each
                                          pool read through the block table as one indexing
                                          expression, which Inductor inlines into the fused
                                          loops as an indirect load (no copy of the pages)
            decomposed_materialized       the static form on paged_layout.static_view (the
                                          pages gathered into contiguous static-layout copies:
                                          its matmuls round by stride on CPU)
            triton_decode, triton_split   the kernels with the block table (triton_paging.py)
            cuda_cpp                      the CUDA C++ kernel with the block table
                                          (cuda/attend.py's attend_cuda_cpp_paged)
"""

from __future__ import annotations

import functools

from ..paged_layout import indexed_view, static_view


def append_form(implementation: str):
    """(layer, key, value, counts, params, pages) -> None for one append implementation."""
    if implementation == "reference":
        from .reference import paged_append_reference

        return paged_append_reference
    if implementation in ("decomposed", "decomposed_cond"):
        from .decomposed_append import append_decomposed

        return functools.partial(_append_decomposed, append_decomposed, implementation == "decomposed_cond")
    if implementation == "triton":
        from .triton_append import append_triton

        return _with_pages(append_triton)
    raise ValueError(f"no append implementation {implementation!r}")


def attend_form(implementation: str):
    """(query, layer, counts, params, scale, pages) -> out for one attention implementation."""
    if implementation == "reference":
        from .reference import paged_attend_reference

        return paged_attend_reference
    if implementation in ("decomposed_fused", "decomposed_materialized"):
        from .decomposed_attend import attend_fused, attend_materialized

        if implementation == "decomposed_fused":
            return functools.partial(_attend_indexed, attend_fused)
        return functools.partial(_attend_gathered, attend_materialized)
    if implementation == "triton_decode":
        from .triton_decode import attend_decode

        return _with_pages(attend_decode)
    if implementation == "triton_split":
        from .triton_split import attend_split

        return _with_pages(attend_split)
    if implementation == "cuda_cpp":
        from ..cuda.attend import attend_cuda_cpp_paged

        return attend_cuda_cpp_paged
    raise ValueError(f"no attend implementation {implementation!r}")


def _append_decomposed(fn, flush_under_cond, layer, key, value, counts, params, pages):
    fn(layer, key, value, counts, params, flush_under_cond=flush_under_cond, pages=pages)


def _attend_gathered(fn, query, layer, counts, params, scale, pages):
    return fn(query, static_view(layer, pages.block_table), counts, params, scale)


def _attend_indexed(fn, query, layer, counts, params, scale, pages):
    return fn(query, indexed_view(layer, pages.block_table), counts, params, scale)


def _with_pages(fn):
    """fn(*args, pages=pages) as fn(*args, pages)."""
    def paged(*args):
        return fn(*args[:-1], pages=args[-1])
    paged.__name__ = f"paged_{fn.__name__}"
    return paged
