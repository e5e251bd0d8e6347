"""kernels/avx2_byte_loads.py: on AVX2, Inductor loads 8 packed bytes with one 8-byte load, and
the compiled code computes exactly what Inductor's own loads compute."""

import pytest
import torch
from torch._inductor import config as inductor_config
from torch._inductor.codegen import cpp
from torch._inductor.cpu_vec_isa import VecAVX2, VecAVX512, pick_vec_isa
from torch._inductor.utils import fresh_cache, run_and_get_code

from kivi_ops.kernels.decomposed import avx2_byte_loads

pytestmark = pytest.mark.skipif(not isinstance(pick_vec_isa(), VecAVX2),
                                reason="the patch changes AVX2 code only; this CPU's ISA is another")


def unpack_and_reduce(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """2-bit codes [T, W] (4 per byte) times a per-column scale, summed per row: the shape of the
    fused decode attention's key loop."""
    shifts = torch.arange(4, dtype=torch.int32)[:, None] * 2
    unpacked = ((codes.to(torch.int32)[:, None, :] >> shifts) & 3).float()  # [T, 4, W]
    return (unpacked * scale).sum((-1, -2))


def compiled_code_and_result(codes, scale):
    torch.compiler.reset()
    with fresh_cache(), inductor_config.patch(cpp_wrapper=False):
        result, (code,) = run_and_get_code(torch.compile(unpack_and_reduce, fullgraph=True), codes, scale)
    return code, result


def test_the_packed_bytes_load_in_one_instruction_and_the_results_are_equal(monkeypatch):
    torch.manual_seed(0)
    codes = torch.randint(0, 256, (512, 16), dtype=torch.uint8)
    scale = torch.randn(4, 16)
    assert avx2_byte_loads.install()
    patched_code, patched = compiled_code_and_result(codes, scale)
    assert "_mm_loadl_epi64" in patched_code
    assert "Vectorized<uint8_t>::loadu(" not in patched_code

    monkeypatch.setattr(cpp.CppVecKernel, "_get_vec_load_line", avx2_byte_loads.original_load_line())
    plain_code, plain = compiled_code_and_result(codes, scale)
    assert "Vectorized<uint8_t>::loadu(" in plain_code  # what the patch replaces is still what Inductor emits
    assert torch.equal(patched, plain)  # the same loops over the same values: bit for bit
    torch.compiler.reset()


def test_code_cached_without_the_patch_is_not_reused_with_it(monkeypatch):
    # One on-disk cache, the same graph: first compiled with Inductor's own loads and no salt (a
    # process before the patch), then with the patch. Without the salt the second compile would
    # load the first one's code from the FX-graph cache and keep ATen's slow loads.
    torch.manual_seed(0)
    codes, scale = torch.randint(0, 256, (512, 16), dtype=torch.uint8), torch.randn(4, 16)
    assert avx2_byte_loads.install()
    salt = inductor_config.post_grad_custom_post_pass
    assert isinstance(salt, avx2_byte_loads.CacheSalt) and salt.uuid()
    patched = cpp.CppVecKernel._get_vec_load_line
    compile_ = lambda: run_and_get_code(torch.compile(unpack_and_reduce, fullgraph=True), codes, scale)  # noqa: E731
    with fresh_cache(), inductor_config.patch(cpp_wrapper=False, fx_graph_cache=True):
        torch.compiler.reset()
        with monkeypatch.context() as unpatched, inductor_config.patch(post_grad_custom_post_pass=None):
            unpatched.setattr(cpp.CppVecKernel, "_get_vec_load_line", avx2_byte_loads.original_load_line())
            _, (plain_code,) = compile_()
        assert "Vectorized<uint8_t>::loadu(" in plain_code
        torch.compiler.reset()
        assert cpp.CppVecKernel._get_vec_load_line is patched
        _, (code,) = compile_()
    assert "_mm_loadl_epi64" in code and "Vectorized<uint8_t>::loadu(" not in code
    torch.compiler.reset()


def test_only_unmasked_quarter_byte_loads_on_avx2_change():
    class Kernel:
        def __init__(self, isa, num_elems):
            self.vec_isa, self.num_elems = isa, num_elems

    avx2 = Kernel(VecAVX2(), 8)
    assert avx2_byte_loads.quarter_byte_load(avx2, torch.uint8, None)
    assert avx2_byte_loads.quarter_byte_load(avx2, torch.int8, None)
    assert not avx2_byte_loads.quarter_byte_load(avx2, torch.float32, None)
    assert not avx2_byte_loads.quarter_byte_load(avx2, torch.uint8, object())  # a masked load
    assert not avx2_byte_loads.quarter_byte_load(Kernel(VecAVX2(), 5), torch.uint8, None)  # a loop's tail
    assert not avx2_byte_loads.quarter_byte_load(Kernel(VecAVX512(), 16), torch.uint8, None)  # ATen's fast path there
