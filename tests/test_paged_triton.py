"""The Triton kernels on a paged layer (kernels/triton/paging.py) against the paged reference
(kernels/reference.py's paged forms) and against the same kernels on the static layer holding the same
sequences: under TRITON_INTERPRET=1 without CUDA (see test_triton_kernels.py).

Bit for bit: a paged launch runs the static kernel's arithmetic on the same values, only the rows
are read through the block table, so its output equals the static launch's exactly (same splits:
the caches have the same capacity). Against the reference the tolerance is the one
test_triton_kernels.py uses for the static kernels (different summation order)."""

import math
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from kivi_ops import KIVIConfig  # noqa: E402
from kivi_ops.kernels.reference import paged_append_reference, paged_attend_reference  # noqa: E402
from kivi_ops.kernels.triton.append import append_triton  # noqa: E402
from kivi_ops.kernels.triton.decode import attend_decode  # noqa: E402
from kivi_ops.kernels.triton.split import attend_split  # noqa: E402
from kivi_ops.calibration.nuq import uniform_levels  # noqa: E402
from paged_helpers import append_both, assert_same_state, make_pair  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ATTEND = {"decode": attend_decode, "split": attend_split}


def _dev(layer_tensors):
    return type(layer_tensors)(*(None if t is None else t.to(DEVICE, copy=True) for t in layer_tensors))


def _pages_dev(pages):
    return pages._replace(block_table=pages.block_table.to(DEVICE, copy=True))


def _filled_pair(cfg, *, B, H, D, dtype, page_size=16, max_pages=5, lengths=(37, 70, 5), seed=0, **kwargs):
    """Static and paged caches (CPU, the reference) holding the same ragged sequences."""
    static, paged, manager = make_pair(cfg, B=B, H=H, D=D, page_size=page_size, max_pages=max_pages, dtype=dtype,
                                       seed=seed, **kwargs)
    g = torch.Generator().manual_seed(seed)
    n = max(lengths)
    key = torch.randn(B, H, n, D, generator=g).to(dtype)
    value = torch.randn(B, H, n, D, generator=g).to(dtype)
    append_both(static, paged, manager, key, value, torch.tensor(lengths[:B]), prefill=True)
    assert_same_state(static, paged)
    return static, paged, manager


def _tol(dtype):
    return 1e-5 if dtype == torch.float32 else 4 * torch.finfo(dtype).eps


CASES = [  # (head_dim, kv heads, query heads, dtype)
    (64, 2, 4, torch.float32), (64, 2, 2, torch.float16), (128, 1, 3, torch.bfloat16), (128, 2, 2, torch.float32),
]


@pytest.mark.parametrize("D,H,HQ,dtype", CASES, ids=lambda x: str(x).split(".")[-1])
@pytest.mark.parametrize("q_len", [1, 3])
def test_paged_attention_kernels_equal_static_and_match_reference(D, H, HQ, dtype, q_len):
    cfg = KIVIConfig(k_bits=2, v_bits=4, group_size=8, residual_length=16)
    B = 3
    static, paged, _ = _filled_pair(cfg, B=B, H=H, D=D, dtype=dtype)
    counts = torch.tensor([q_len, q_len - 1 if q_len > 1 else 0, q_len])
    query = torch.randn(B, HQ, q_len, D, generator=torch.Generator().manual_seed(1)).to(dtype)
    scale = 1 / math.sqrt(D)
    sl, pl = static.layers[0], paged.layers[0]
    want = paged_attend_reference(query, pl.tensors(), counts, pl.params, scale, pl.pages)
    for kernel in (("decode", "split") if q_len == 1 else ("split",)):
        fn = ATTEND[kernel]
        got_static = fn(query.to(DEVICE), _dev(sl.tensors()), counts.to(DEVICE), sl.params, scale)
        got = fn(query.to(DEVICE), _dev(pl.tensors()), counts.to(DEVICE), pl.params, scale, pages=_pages_dev(pl.pages))
        assert torch.equal(got.cpu(), got_static.cpu()), kernel
        torch.testing.assert_close(got.cpu().float(), want.float(), rtol=_tol(dtype), atol=_tol(dtype), msg=kernel)
        assert not torch.equal(got.cpu(), torch.zeros_like(got.cpu()))


APPEND_CASES = [  # (head_dim, kv heads, dtype, k_bits, v_bits)
    (64, 2, torch.float32, 2, 2), (64, 1, torch.float16, 4, 2), (128, 2, torch.bfloat16, 2, 4),
]


def _triton_append(layer, key, value, counts, pages):
    t = _dev(layer.tensors())
    append_triton(t, key.to(DEVICE), value.to(DEVICE), None if counts is None else counts.to(DEVICE), layer.params,
                  pages=_pages_dev(pages))
    return t


@pytest.mark.parametrize("D,H,dtype,kb,vb", APPEND_CASES, ids=lambda x: str(x).split(".")[-1])
@pytest.mark.parametrize("n", [1, 21])
def test_paged_append_kernel_writes_the_reference_bits(D, H, dtype, kb, vb, n):
    """One decode token (one launch: value flush, residual, key window flush) and a 21-token chunk
    (key windows, value flush, residual kernels) on ragged rows, the rows flushing at different
    steps: every page and row tensor equals the paged reference's."""
    cfg = KIVIConfig(k_bits=kb, v_bits=vb, group_size=8, residual_length=16)
    B = 3
    _, paged, manager = _filled_pair(cfg, B=B, H=H, D=D, dtype=dtype, lengths=(31, 47, 15))
    layer = paged.layers[0]
    g = torch.Generator().manual_seed(2)
    key = torch.randn(B, H, n, D, generator=g).to(dtype)
    value = torch.randn(B, H, n, D, generator=g).to(dtype)
    counts = torch.tensor([n, 0, max(n - 4, 1)])
    manager.reserve(counts.tolist())
    got = _triton_append(layer, key, value, counts, layer.pages)
    paged_append_reference(layer.tensors(), key, value, counts, layer.params, layer.pages)
    for name, want in layer.tensors()._asdict().items():
        if want is not None:
            assert torch.equal(getattr(got, name).cpu(), want), name


def test_paged_append_kernel_with_nuq_levels():
    levels = tuple(float(x) for x in uniform_levels(2).tolist())
    skewed = (0.0, 0.5, 2.5, 3.0)
    cfg = KIVIConfig(k_bits=2, v_bits=2, group_size=8, residual_length=16, key_levels=(skewed,),
                     value_levels=(levels,))
    _, paged, manager = _filled_pair(cfg, B=2, H=2, D=64, dtype=torch.float16, lengths=(31, 14))
    layer = paged.layers[0]
    g = torch.Generator().manual_seed(3)
    key, value = torch.randn(2, 2, 1, 64, generator=g).half(), torch.randn(2, 2, 1, 64, generator=g).half()
    manager.reserve([1, 1])
    got = _triton_append(layer, key, value, None, layer.pages)
    paged_append_reference(layer.tensors(), key, value, None, layer.params, layer.pages)
    for name, want in layer.tensors()._asdict().items():
        if want is not None:
            assert torch.equal(getattr(got, name).cpu(), want), name


@pytest.mark.parametrize("q_len", [1, 2])
def test_paged_attention_kernels_with_nuq_levels_and_pre_rope_keys(q_len):
    D = 64
    cfg = KIVIConfig(k_bits=2, v_bits=2, group_size=8, residual_length=16, pre_rope=True,
                     key_levels=((0.0, 0.4, 2.2, 3.0),), value_levels=((0.0, 1.0, 1.5, 3.0),))
    inv_freq = 1.0 / (10000 ** (torch.arange(0, D, 2, dtype=torch.float32) / D))
    static, paged, _ = _filled_pair(cfg, B=2, H=2, D=D, dtype=torch.float16, lengths=(45, 20),
                                    rope_inv_freq=inv_freq, rope_scaling=1.0)
    query = torch.randn(2, 4, q_len, D, generator=torch.Generator().manual_seed(4)).half()
    sl, pl = static.layers[0], paged.layers[0]
    want = paged_attend_reference(query, pl.tensors(), None, pl.params, 0.125, pl.pages)
    for kernel in (("decode", "split") if q_len == 1 else ("split",)):
        fn = ATTEND[kernel]
        got_static = fn(query.to(DEVICE), _dev(sl.tensors()), None, sl.params, 0.125)
        got = fn(query.to(DEVICE), _dev(pl.tensors()), None, pl.params, 0.125, pages=_pages_dev(pl.pages))
        assert torch.equal(got.cpu(), got_static.cpu()), kernel
        tol = 4 * torch.finfo(torch.float16).eps
        torch.testing.assert_close(got.cpu().float(), want.float(), rtol=tol, atol=tol, msg=kernel)
