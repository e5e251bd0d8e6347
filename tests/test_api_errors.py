"""Public API edges from the user audit: counts given as a list, attend on an empty cache,
quantize with a zero-size head dim or zero tokens, and KIVIConfig's residual_length message."""

import numpy as np
import pytest
import torch

from kivi_ops import FPCache, KIVICache, KIVIConfig, KIVILayer, Step, fake_quantize, quantize
from kivi_ops.dispatch import implementations

B, H, D = 2, 2, 16


def make_cache(portable=False, **cfg):
    return KIVICache(KIVIConfig(group_size=4, residual_length=8, **cfg), num_layers=1, batch_size=B,
                     max_seq_len=32, num_kv_heads=H, head_dim=D, portable=portable)


def kv(n):
    return torch.randn(B, H, n, D), torch.randn(B, H, n, D)


# ---------------------------------------------------------------- counts must be a tensor

NOT_TENSORS = [[1, 2], (1, 2), np.array([1, 2])]
COUNTS_ERROR = r"counts must be an int64 tensor of shape \[2\] on cpu \(or None\).*got (list|tuple|ndarray)"


@pytest.mark.parametrize("counts", NOT_TENSORS, ids=["list", "tuple", "numpy"])
@pytest.mark.parametrize("portable", [False, True])
def test_counts_not_a_tensor_is_a_clear_error(counts, portable):
    cache = make_cache(portable)
    before = [b.clone() for b in cache.buffers()]
    with pytest.raises(ValueError, match=COUNTS_ERROR):
        cache.layers[0].append(*kv(2), Step(counts=counts))
    with pytest.raises(ValueError, match=COUNTS_ERROR):
        cache.layers[0].attend(torch.randn(B, H, 2, D), Step(counts=counts))
    with pytest.raises(ValueError, match=COUNTS_ERROR):
        cache.layers[0].check_room(2, counts)
    assert all(torch.equal(a, b) for a, b in zip(before, cache.buffers()))  # nothing written


def test_counts_tensor_errors_still_name_the_expected_type():
    cache = make_cache()
    with pytest.raises(ValueError, match=r"counts must be an int64 tensor of shape \[2\] on cpu \(or None\), got "
                                         r"torch.int32 \[2\] on cpu"):
        cache.layers[0].append(*kv(2), Step(counts=torch.tensor([1, 2], dtype=torch.int32)))


def test_fp_cache_counts_not_a_tensor_is_a_clear_error():
    # FPLayer shares KIVILayer's counts check (CacheLayer): type, shape, dtype, range.
    cache = FPCache(num_layers=1, batch_size=B, max_seq_len=32, num_kv_heads=H, head_dim=D)
    with pytest.raises(ValueError, match="counts must be an int64 tensor"):
        cache.layers[0].append(*kv(2), Step(counts=[1, 2]))
    with pytest.raises(ValueError, match=r"counts must lie in \[0, 2\]"):
        cache.layers[0].append(*kv(2), Step(counts=torch.tensor([3] + [1] * (B - 1))))
    with pytest.raises(ValueError, match="counts must be an int64 tensor"):
        cache.layers[0].attend(torch.randn(B, H, 1, D), Step(counts=[1] * B))
    assert int(cache.lengths().sum()) == 0  # nothing was written


# ---------------------------------------------------------------- attend with no visible key


def test_attend_docstring_defines_empty_rows_as_zeros():
    doc = " ".join(KIVILayer.attend.__doc__.split())
    assert "zeros when its query sees no key" in doc and "attend before any append" in doc


@pytest.mark.parametrize("portable", [False, True])
@pytest.mark.parametrize("q_len", [1, 3])
@pytest.mark.parametrize("sink_tokens", [0, 2])
def test_attend_on_an_empty_cache_returns_zeros(portable, q_len, sink_tokens):
    cache = make_cache(portable, sink_tokens=sink_tokens)
    query = torch.randn(B, 2 * H, q_len, D)
    assert torch.equal(cache.layers[0].attend(query), torch.zeros_like(query))  # before any append
    assert torch.equal(cache.layers[0].attend(query, Step(counts=torch.tensor([q_len, 0]))), torch.zeros_like(query))
    cache.layers[0].append(*kv(20))
    assert cache.layers[0].attend(query).abs().sum() > 0
    cache.reset()
    assert torch.equal(cache.layers[0].attend(query), torch.zeros_like(query))  # after reset


@pytest.mark.parametrize("portable", [False, True])
def test_rows_that_see_no_key_are_zeros_beside_rows_that_do(portable):
    cache = make_cache(portable)
    cache.layers[0].append(*kv(3), Step(counts=torch.tensor([3, 0])))  # row 1 stays empty
    query = torch.randn(B, 2 * H, 5, D)
    out = cache.layers[0].attend(query)  # no counts: query i at position lengths - 5 + i
    assert not out.isnan().any()
    assert torch.equal(out[1], torch.zeros_like(out[1]))  # empty sequence
    assert torch.equal(out[0, :, :2], torch.zeros_like(out[0, :, :2]))  # positions -2, -1
    assert (out[0, :, 2:].abs().sum(-1) > 0).all()  # positions 0..2
    cache.restart_rows(torch.tensor([True, False]))
    assert torch.equal(cache.layers[0].attend(query), torch.zeros_like(out))


def test_decode_form_of_an_empty_cache_returns_zeros():
    # decomposed_fused is what a compiled CPU decode step (q_len = 1) runs: same contract.
    cache = make_cache()
    query = torch.randn(B, 2 * H, 1, D)
    out = implementations.run_attend("decomposed_fused", query, cache.layers[0].tensors(), None, cache.layers[0].params, 0.25)
    assert torch.equal(out, torch.zeros_like(query))


def test_fp_cache_attend_on_an_empty_cache_returns_zeros():
    cache = FPCache(num_layers=1, batch_size=B, max_seq_len=32, num_kv_heads=H, head_dim=D)
    query = torch.randn(B, 2 * H, 1, D)
    assert torch.equal(cache.layers[0].attend(query), torch.zeros_like(query))


# ---------------------------------------------------------------- quantize at zero sizes

AXES = ["channel", "token"]


@pytest.mark.parametrize("axis", AXES)
@pytest.mark.parametrize("shape", [(2, 8, 0), (8, 0)])
def test_quantize_zero_size_head_dim_is_a_clear_error(axis, shape):
    x = torch.randn(shape)
    match = r"x's last dim \(head dim\) must be positive, got D=0"
    with pytest.raises(ValueError, match=match):
        quantize(x, 2, 4, axis)
    with pytest.raises(ValueError, match=match):
        torch.ops.kivi.quantize_pack(x, 2, 4, axis)
    with torch._subclasses.FakeTensorMode() as mode:  # the fake kernel (trace time) says the same
        with pytest.raises(ValueError, match=match):
            torch.ops.kivi.quantize_pack(mode.from_tensor(x), 2, 4, axis)


@pytest.mark.parametrize("axis", AXES)
def test_dequantize_zero_size_head_dim_is_a_clear_error(axis):
    codes, scale = torch.zeros(8, 0, dtype=torch.uint8), torch.zeros(8, 0)
    with pytest.raises(ValueError, match="codes' last dim must be positive"):
        torch.ops.kivi.unpack_dequantize(codes, scale, scale, 2, 4, axis)
    with pytest.raises(ValueError, match="at least 2 dims"):
        torch.ops.kivi.unpack_dequantize(torch.zeros(4, dtype=torch.uint8), scale, scale, 2, 4, axis)


@pytest.mark.parametrize("axis", AXES)
@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("shape", [(2, 0, 16), (0, 16), (0, 4, 16)])
def test_quantize_zero_tokens_is_an_empty_result(axis, bits, shape):
    x = torch.randn(shape, dtype=torch.float16)
    q = quantize(x, bits, 4, axis)
    *lead, T, _ = shape
    groups = (*lead, T // 4, 16) if axis == "channel" else (*lead, T, 16 // 4)
    assert q.codes.shape == (*lead, T, 16 * bits // 8) and q.codes.dtype == torch.uint8
    assert q.scale.shape == groups and q.zero.shape == groups and q.dtype == torch.float16
    assert q.shape == x.shape and q.nbytes() == 0
    out = q.dequantize()
    assert out.shape == x.shape and out.dtype == x.dtype
    assert fake_quantize(x, bits, 4, axis).shape == x.shape
    torch.library.opcheck(torch.ops.kivi.quantize_pack.default, (x, bits, 4, axis))
    torch.library.opcheck(torch.ops.kivi.unpack_dequantize.default, (q.codes, q.scale, q.zero, bits, 4, axis))


# ---------------------------------------------------------------- KIVIConfig names its fields


def test_residual_length_error_names_the_python_argument():
    # KIVIConfig is a Python API: its message names `residual_length`, not the CLI's
    # `--residual-length` (the CLI translates field names into its flags).
    with pytest.raises(ValueError, match="residual_length must be a positive multiple of group_size=32") as e:
        KIVIConfig(group_size=32, residual_length=30)
    assert "--" not in str(e.value)
