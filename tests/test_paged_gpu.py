"""The paged KIVI cache on CUDA (the Triton kernels through dispatch.py, inside the kivi::paged_*
ops): equal to the static cache bit for bit, eagerly and in a decode step compiled with CUDA graphs.
Skipped without CUDA; on the lent GPU: `python3 -m pytest -q tests/test_paged_gpu.py
tests/test_paged_triton.py`."""

import pytest
import torch

from kivi_ops import KIVIConfig, Step
from paged_helpers import append_both, assert_same_state, make_pair

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

CFG = KIVIConfig(k_bits=2, v_bits=2, group_size=8, residual_length=16)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_paged_equals_static_on_cuda(dtype, head_dim):
    B, H, HQ = 3, 2, 4
    static, paged, manager = make_pair(CFG, B=B, H=H, D=head_dim, page_size=16, max_pages=8, dtype=dtype,
                                       device="cuda")
    g = torch.Generator(device="cuda").manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=g, device="cuda").to(dtype)

    counts = torch.tensor([40, 7, 33], device="cuda")
    append_both(static, paged, manager, rand(B, H, 40, head_dim), rand(B, H, 40, head_dim), counts, prefill=True)
    for step in range(40):
        q_len = 4 if step % 9 == 8 else 1
        c = torch.tensor([q_len, q_len if step % 3 else 0, q_len], device="cuda")
        append_both(static, paged, manager, rand(B, H, q_len, head_dim), rand(B, H, q_len, head_dim), c)
        q = rand(B, HQ, q_len, head_dim)
        assert torch.equal(paged.layers[0].attend(q, Step(counts=c)), static.layers[0].attend(q, Step(counts=c)))
    assert_same_state(static, paged)


def test_cuda_graph_decode_step_on_pages_equals_eager():
    B, H, HQ, D = 2, 2, 4, 64
    static, paged, manager = make_pair(CFG, B=B, H=H, D=D, page_size=16, max_pages=8, dtype=torch.float16,
                                       device="cuda")
    x = torch.randn(B, H, 30, D, device="cuda", dtype=torch.float16)
    append_both(static, paged, manager, x, x, prefill=True)
    manager.reserve([60, 60])  # the graph cannot allocate: every page the steps need, up front

    def step(layer, k, v, q):
        layer.append(k, v)
        return layer.attend(q)

    compiled = torch.compile(step, fullgraph=True, mode="reduce-overhead")
    with torch.no_grad():
        for i in range(40):
            k, v, q = (torch.randn(B, n, 1, D, device="cuda", dtype=torch.float16) for n in (H, H, HQ))
            got = compiled(paged.layers[0], k, v, q).clone()
            want = step(static.layers[0], k, v, q)
            assert torch.equal(got, want), i
    assert_same_state(static, paged)
