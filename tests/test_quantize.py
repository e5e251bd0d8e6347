"""Quantize/pack ops: numerics, packing, op registration, compile/export, bad input."""

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kivi_ops
from kivi_ops import KIVIConfig, fake_quantize, quantize
from kivi_ops.kernels.reference.packing import pack, unpack

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def error_bound(x, scale_per_elem, bits):
    """|x - x'| <= scale/2 in exact arithmetic. Storage adds: the zero point rounded to the
    dtype (<= eps*|x|), the scale rounded to the dtype (times up to 2^B-1 codes), and the final
    cast of x' (<= eps*|x'|)."""
    eps = torch.finfo(x.dtype).eps
    s = scale_per_elem.float()
    return s / 2 + eps * (2 * x.float().abs() + (2**bits) * s) + 1e-30


def per_element(t, group_size, axis, head_dim):
    from kivi_ops.kernels.reference.packing import expand_groups

    return expand_groups(t, group_size, axis, head_dim)


def test_config_defaults_and_errors():
    c = KIVIConfig()
    assert (c.k_bits, c.v_bits, c.group_size, c.residual_length) == (2, 2, 32, 128)
    with pytest.raises(ValueError, match=r"k_bits must be one of \(2, 3, 4, 8\), got 5"):
        KIVIConfig(k_bits=5)
    # 3-bit words hold 8 codes (8 per 3 bytes): a value group must hold whole words
    with pytest.raises(ValueError, match="v_bits=3 packs 8 codes per word .* multiple of 8 .* got group_size=4"):
        KIVIConfig(v_bits=3, group_size=4, residual_length=8)
    KIVIConfig(k_bits=3, v_bits=2, group_size=8, residual_length=16)
    with pytest.raises(ValueError, match="v_bits must be one of"):
        KIVIConfig(v_bits=1)
    with pytest.raises(ValueError, match="group_size must be one of"):
        KIVIConfig(group_size=0)
    with pytest.raises(ValueError, match="residual_length must be a positive multiple of group_size=32"):
        KIVIConfig(residual_length=100)
    with pytest.raises(ValueError, match="residual_length"):
        KIVIConfig(residual_length=0)
    KIVIConfig(k_bits=4, v_bits=8, group_size=128, residual_length=128)


def test_numerics_match_formula_by_hand():
    # One channel group of 4 tokens, 2 bits: min -1, max 2 -> scale 1, zero -1.
    x = torch.tensor([[-1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]] * 4)
    x[:, 0] = torch.tensor([-1.0, 0.4, 0.6, 2.0])
    q = quantize(x, 2, 4, "channel")
    assert q.scale[0, 0] == 1.0 and q.zero[0, 0] == -1.0
    codes = unpack(q.codes, 2)[:, 0]
    # (x - zero) / scale = 0, 1.4, 1.6, 3 -> round half up -> 0, 1, 2, 3
    assert codes.tolist() == [0, 1, 2, 3]
    assert q.dequantize()[:, 0].tolist() == [-1.0, 0.0, 1.0, 2.0]
    # Other channels are constant zero: scale 0, reconstruct exactly.
    assert (q.scale[0, 1:] == 0).all() and (q.dequantize()[:, 1:] == 0).all()


def test_round_half_up_on_ties():
    # 4-bit, group [0, 15]: scale 1; 7.5 is a tie and rounds up to 8 (torch.round would give 8 too,
    # but 6.5 -> 7 here where round-half-even gives 6).
    x = torch.tensor([[0.0, 6.5, 7.5, 15.0] + [0.0] * 4])
    q = quantize(x, 4, 4, "token")
    assert unpack(q.codes, 4)[0, :4].tolist() == [0, 7, 8, 15]


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_pack_unpack_roundtrip_every_code(bits):
    per = 8 if bits == 3 else 8 // bits
    codes = torch.arange(2**bits, dtype=torch.uint8).repeat(per * 3)[: per * 2**bits * 2].reshape(4, -1)
    packed = pack(codes, bits)
    assert packed.dtype == torch.uint8 and packed.shape[-1] == codes.shape[-1] * bits // 8
    assert torch.equal(unpack(packed, bits), codes)
    # Little end first: the first code sits in the lowest bits.
    if bits == 2:
        assert pack(torch.tensor([[1, 2, 3, 0]], dtype=torch.uint8), 2).item() == 1 | (2 << 2) | (3 << 4)


def test_three_bit_layout_is_eight_codes_per_three_byte_planes():
    """3-bit codes: word j = sum_i q[8j + i] << 3i (24 bits, little end first), stored as three
    byte planes of D/8 bytes each (packing.py): byte p * D/8 + j = (word j >> 8p) & 255."""
    codes = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7, 7, 6, 5, 4, 3, 2, 1, 0]], dtype=torch.uint8)
    words = [sum(int(c) << (3 * i) for i, c in enumerate(codes[0, 8 * j : 8 * j + 8])) for j in range(2)]
    want = [(w >> (8 * p)) & 255 for p in range(3) for w in words]
    packed = pack(codes, 3)
    assert packed.tolist() == [want] and packed.shape == (1, 6)  # 16 codes, 6 bytes: exactly 3 bits each
    assert torch.equal(unpack(packed, 3), codes)


@pytest.mark.parametrize("bits,axis,dtype,head_dim", itertools.product([2, 3, 4, 8], ["channel", "token"], DTYPES,
                                                                       [64, 128]))
def test_error_within_half_scale(bits, axis, dtype, head_dim):
    torch.manual_seed(bits + head_dim)
    x = (torch.randn(2, 3, 64, head_dim) * 3).to(dtype)
    q = quantize(x, bits, 32, axis)
    assert q.codes.shape == (2, 3, 64, head_dim * bits // 8) and q.codes.dtype == torch.uint8
    assert q.scale.dtype == dtype and q.dequantize().dtype == dtype and q.dequantize().shape == x.shape
    s = per_element(q.scale, 32, axis, head_dim)
    err = (q.dequantize().float() - x.float()).abs()
    assert (err <= error_bound(x, s, bits)).all()
    assert torch.equal(fake_quantize(x, bits, 32, axis), q.dequantize())


@pytest.mark.parametrize("axis", ["channel", "token"])
def test_constant_groups_reconstruct_exactly(axis):
    x = torch.full((1, 64, 64), 0.3, dtype=torch.bfloat16)
    q = quantize(x, 2, 32, axis)
    assert (q.scale == 0).all()
    assert torch.equal(q.dequantize(), x)


def test_group_larger_than_head_dim_is_clipped_for_values():
    x = torch.randn(5, 64)
    q = quantize(x, 4, 128, "token")
    assert q.scale.shape == (5, 1)


@settings(max_examples=40, deadline=None)
@given(
    lead=st.lists(st.integers(1, 3), min_size=0, max_size=2),
    groups=st.integers(1, 4),
    group_size=st.sampled_from([8, 32, 64]),
    head_dim=st.sampled_from([8, 64, 128]),
    bits=st.sampled_from([2, 3, 4, 8]),
    axis=st.sampled_from(["channel", "token"]),
    outliers=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_property_random_shapes_with_outlier_channels(lead, groups, group_size, head_dim, bits, axis, outliers, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*lead, groups * group_size, head_dim, generator=g)
    if outliers:  # real keys: a few channels carry values ~20x larger than the rest
        x[..., : max(1, head_dim // 16)] *= 20
    q = quantize(x, bits, group_size, axis)
    s = per_element(q.scale, group_size, axis, head_dim)
    assert ((q.dequantize() - x).abs() <= error_bound(x, s, bits)).all()
    assert int(unpack(q.codes, bits).max()) <= 2**bits - 1


def test_opcheck_quantize_ops():
    x = torch.randn(2, 64, 64)
    for axis in ("channel", "token"):
        torch.library.opcheck(torch.ops.kivi.quantize_pack.default, (x, 2, 32, axis))
        for bits in (3, 4):
            codes, scale, zero = torch.ops.kivi.quantize_pack(x, bits, 32, axis)
            torch.library.opcheck(torch.ops.kivi.unpack_dequantize.default, (codes, scale, zero, bits, 32, axis))


def _roundtrip(k, v):
    return fake_quantize(k, 2, 32, "channel") + fake_quantize(v, 2, 32, "token")


def test_compile_fullgraph_matches_eager():
    k, v = torch.randn(1, 3, 64, 64), torch.randn(1, 3, 64, 64)
    compiled = torch.compile(_roundtrip, fullgraph=True)
    assert torch.equal(compiled(k, v), _roundtrip(k, v))


def test_export_keeps_kivi_ops():
    class M(torch.nn.Module):
        def forward(self, k, v):
            return _roundtrip(k, v)

    ep = torch.export.export(M(), (torch.randn(1, 3, 64, 64), torch.randn(1, 3, 64, 64)))
    targets = {str(n.target) for n in ep.graph.nodes if n.op == "call_function"}
    assert "kivi.quantize_pack.default" in targets and "kivi.unpack_dequantize.default" in targets


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(x=torch.randint(0, 5, (64, 64))), "x must have dtype float32"),
        (dict(bits=5), r"bits must be one of \(2, 3, 4, 8\)"),
        (dict(bits=3, axis="token", group_size=4), "multiple of 8 .*whole words"),
        (dict(group_size=0), "group_size must be one of"),
        (dict(group_size=48), "group_size must be one of"),
        (dict(x=torch.randn(40, 64)), "multiple of group_size=32"),
        (dict(x=torch.randn(64)), "at least 2 dims"),
        (dict(x=torch.randn(64, 6)), "multiple of 4 to pack"),
        (dict(axis="row"), "axis must be one of"),
    ],
)
def test_bad_input_raises_clear_errors(kwargs, match):
    args = dict(x=torch.randn(64, 64), bits=2, group_size=32, axis="channel") | kwargs
    with pytest.raises(ValueError, match=match):
        quantize(**args)


def test_dequantize_rejects_mismatched_scale():
    q = quantize(torch.randn(64, 64), 2, 32, "channel")
    with pytest.raises(ValueError, match="scale/zero must have shape"):
        torch.ops.kivi.unpack_dequantize(q.codes, q.scale[:1], q.zero[:1], 2, 32, "channel")


def test_public_api_names():
    for name in ("KIVIConfig", "KIVICache", "quantize", "fake_quantize"):
        assert hasattr(kivi_ops, name)


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_unpack_float_table_equals_unpack(bits):
    from kivi_ops.kernels.reference.packing import unpack_float

    packed = torch.arange(256, dtype=torch.uint8).reshape(4, 64)
    if bits == 3:  # rows of 3-byte words: 21 words, every byte value in some plane
        packed = torch.cat([packed, packed[:, :1]], -1)[:, :63]
    assert torch.equal(unpack_float(packed, bits), unpack(packed, bits).float())
