"""Inductor's AVX2 code loads 8 packed bytes in one load instead of ATen's stack round trip, which
stalls on store-to-load forwarding; a cache salt keeps Inductor's FX-graph cache apart for code
generated with and without the patch (docs/performance.md)."""

from __future__ import annotations

import logging

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

log = logging.getLogger(__name__)

_original_load_line = None


def install() -> bool:
    """Patch Inductor's vector load line once per process; False if the wrapped method is gone."""
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
            # Ones past the 8 bytes, as ATen's slow path builds, so that no lane divides by zero.
            return f"{self._get_vec_type(dtype)}(_mm256_blend_epi32(_mm256_set1_epi8(1), {eight_bytes}, 0x03))"
        return line

    cpp.CppVecKernel._get_vec_load_line = vec_load_line
    _original_load_line = original
    _salt_cache_key()
    return True


class CacheSalt(CustomGraphPass):
    """A no-op post-grad pass; its uuid (this file's hash) keys Inductor's cache."""

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
    return _original_load_line


def quarter_byte_load(kernel, dtype: torch.dtype, load_mask) -> bool:
    """An unmasked load of 8 one-byte elements into a 32-lane AVX2 vector."""
    from torch._inductor.cpu_vec_isa import VecAVX2

    return (dtype in (torch.uint8, torch.int8) and load_mask is None and isinstance(kernel.vec_isa, VecAVX2)
            and kernel.num_elems == 8)
