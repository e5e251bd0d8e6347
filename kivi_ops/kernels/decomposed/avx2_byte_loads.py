"""Inductor's AVX2 code loads 8 bytes without a round trip through memory.

Inductor's CPU loops are tiled by fp32 lanes (8 on AVX2), so a loop that reads our packed uint8
codes loads 8 bytes per vector: `Vectorized<uint8_t>::loadu(ptr, 8)`. On AVX2 ATen implements
that partial load by filling a 32-byte stack buffer with ones, copying the 8 bytes over it and
loading the 32 bytes back: the load straddles two stores, store-to-load forwarding fails, and every
code load stalls. ATen's AVX-512 build takes a fast path for its quarter load (`loadu(ptr, 16)`
of 64 lanes is `loadu_one_fourth`, one 16-byte load) and its AVX2 build has the same
`loadu_one_fourth` (one 8-byte load), which Inductor never emits.

`install()` makes Inductor emit one 8-byte load for exactly that case (an unmasked load of 8
one-byte elements on AVX2), blended into a vector of ones: the same value ATen's slow path builds
(ones past the 8 bytes, so that no lane divides by zero), without the stores.

Measured (lab/decomposed_attend_cpu.py's fused decode attention, context 8192, batch 1, 9 query
and 3 KV heads of 64 channels, KIVI-2, one thread, the 2-core AMD EPYC AVX2 machine, torch 2.13.0,
one process per side with its own Inductor cache): 5.85 ms before, 2.26 ms after, the outputs
equal (benchmarks/results/avx2_byte_loads/). Every compile of ours installs it
(compile_budget.compile_own_code); other code compiled in the process gets the same loads.

Inductor's on-disk FX-graph cache reuses code as it was generated, and its key does not see a
patched code generator. So install() also sets a no-op post-grad pass (`CacheSalt`) whose uuid,
the hash of this file, enters that key: code generated with these loads is cached apart from code
generated without them, both ways (a cache filled before this existed, or by a process without
the patch, is not reused). A post-grad pass the user set already is left alone (then the cache
may mix the two; both compute the same bits, only speed differs).
"""

from __future__ import annotations

import logging

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

log = logging.getLogger(__name__)

_original_load_line = None  # Inductor's own, once install() has wrapped it


def install() -> bool:
    """Patch Inductor's vector load line once per process; True if the patch is in place. Leaves
    Inductor alone (False) if its code generator no longer has the method this wraps."""
    global _original_load_line
    if _original_load_line is not None:
        _salt_cache_key()  # again: make test's workers lost an earlier call's salt (the cause was not found)
        return True
    from torch._inductor.codegen import cpp

    original = getattr(cpp.CppVecKernel, "_get_vec_load_line", None)
    if original is None:
        return False

    def vec_load_line(self, var, index, dtype, load_mask=None):
        line = original(self, var, index, dtype, load_mask)
        if quarter_byte_load(self, dtype, load_mask):
            loadbuf = f"{var} + {cpp.cexpr_index(index)}" if index != 0 else var
            eight_bytes = f"_mm256_castsi128_si256(_mm_loadl_epi64(reinterpret_cast<const __m128i*>({loadbuf})))"
            return f"{self._get_vec_type(dtype)}(_mm256_blend_epi32(_mm256_set1_epi8(1), {eight_bytes}, 0x03))"
        return line

    cpp.CppVecKernel._get_vec_load_line = vec_load_line
    _original_load_line = original
    _salt_cache_key()
    return True


class CacheSalt(CustomGraphPass):
    """A post-grad pass that changes nothing; its uuid (this file's hash) keys Inductor's cache."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        return None

    def uuid(self) -> bytes:
        return get_hash_for_files((__file__,))


def _salt_cache_key() -> None:
    from torch._inductor import config

    if config.post_grad_custom_post_pass is None:
        config.post_grad_custom_post_pass = CacheSalt()
    elif not isinstance(config.post_grad_custom_post_pass, CacheSalt):
        log.info("post_grad_custom_post_pass is set already: Inductor's cache is not keyed by the AVX2 byte loads")


def original_load_line():
    """Inductor's own load-line method (None before install()): tests compile with it to compare."""
    return _original_load_line


def quarter_byte_load(kernel, dtype: torch.dtype, load_mask) -> bool:
    """An unmasked load of 8 one-byte elements into a 32-lane AVX2 vector."""
    from torch._inductor.cpu_vec_isa import VecAVX2

    return (dtype in (torch.uint8, torch.int8) and load_mask is None and isinstance(kernel.vec_isa, VecAVX2)
            and kernel.num_elems == 8)
