"""Rotated caches (KIVIConfig.rotate_keys / rotate_values, kivi_ops/options/rotation.py): the rotation is
orthogonal, attention through a rotated cache is the unrotated attention (exactly where nothing is
quantized, over what the cache stores where it is), the static, paged, compiled and exported paths
agree, and the cache's bytes do not change. The fake-quantization baselines (FP8, per-token-head
int) are checked against their error bounds."""

import math

import pytest
import torch
import torch.nn.functional as F

from kivi_ops import KIVICache, KIVIConfig, Step
from kivi_ops.options.rotation import ROTATIONS, fwht, random_orthogonal, rotate, rotation_matrix, unrotate
from paged_helpers import append_both, make_pair

# fp32 rounding of a product by an orthogonal matrix and back: each output sums D products of
# unit-scale numbers, error ~ sqrt(D) * 2^-24 * |x| ~ 1e-6 for D <= 256; 1e-5 bounds it with room
# (a wrong sign or a transposed matrix moves entries by ~1).
ORTHO_ATOL = 1e-5
# Attention over the same fp32 keys and values, summed in another order (the op's online softmax
# against SDPA) and through the rotation: test_decomposed.py's 1e-5 argument.
ATOL = RTOL = 1e-5

B, H, HQ, D = 2, 2, 4, 64


def _kv(T, seed=0, outlier=True):
    g = torch.Generator().manual_seed(seed)
    k, v = torch.randn(B, H, T, D, generator=g), torch.randn(B, H, T, D, generator=g)
    if outlier:
        k[..., 3] *= 10  # an outlier channel, as real keys have
    return k, v, torch.randn(B, HQ, 1, D, generator=g)


def _sdpa(q, k, v):
    return F.scaled_dot_product_attention(q, k.repeat_interleave(HQ // H, 1), v.repeat_interleave(HQ // H, 1))


@pytest.mark.parametrize("kind,dim", [("hadamard", 64), ("hadamard", 128), ("hadamard", 256), ("random", 64),
                                      ("hadamard", 48), ("random", 40)])
def test_rotation_is_orthogonal(kind, dim):
    m = rotation_matrix(kind, dim)
    assert m.dtype == torch.float32 and m.shape == (dim, dim)
    torch.testing.assert_close(m @ m.t(), torch.eye(dim), atol=ORTHO_ATOL, rtol=0)
    x = torch.randn(3, 5, dim)
    torch.testing.assert_close(unrotate(rotate(x, m), m), x, atol=ORTHO_ATOL, rtol=0)
    if kind == "hadamard" and dim & (dim - 1) == 0:  # Walsh–Hadamard: every entry +-1/sqrt(D)
        assert torch.allclose(m.abs(), torch.full_like(m, dim**-0.5))
        torch.testing.assert_close(fwht(x), x @ m, atol=ORTHO_ATOL, rtol=0)
        torch.testing.assert_close(fwht(fwht(x)), x, atol=ORTHO_ATOL, rtol=0)
    else:  # not a power of two: the seeded random matrix
        assert torch.equal(m, random_orthogonal(dim, 0))


def test_random_rotation_is_seeded():
    assert torch.equal(random_orthogonal(64, 3), random_orthogonal(64, 3))
    assert not torch.equal(random_orthogonal(64, 3), random_orthogonal(64, 4))
    assert rotation_matrix("none", 64) is None


@pytest.mark.parametrize("field", ["rotate_keys", "rotate_values"])
def test_bad_rotation_is_refused_naming_the_parameter(field):
    with pytest.raises(ValueError, match=rf"{field} must be one of \('none', 'hadamard', 'random', 'calibrated'\), got 'fast'"):
        KIVIConfig(**{field: "fast"})
    with pytest.raises(ValueError, match="rotation_seed must be an int"):
        KIVIConfig(rotation_seed=1.5)


def test_pre_rope_keys_refuse_key_rotation():
    with pytest.raises(ValueError, match="rotate_keys='hadamard' is not supported with pre_rope=True"):
        KIVIConfig(pre_rope=True, rotate_keys="hadamard")
    KIVIConfig(pre_rope=True, rotate_values="hadamard")  # values are independent of RoPE


def test_cli_names_the_flag(capsys):
    from kivi_cli.main import main

    with pytest.raises(SystemExit) as e:
        main(["generate", "--prompt", "x", "--rotate-keys", "fast"])
    assert e.value.code == 2
    assert "--rotate-keys: invalid choice: 'fast' (choose from 'none', 'hadamard', 'random', 'calibrated')" in capsys.readouterr().err


def _cache(T_max=256, **options):
    cfg = KIVIConfig(k_bits=2, v_bits=2, group_size=32, residual_length=128, **options)
    return KIVICache(cfg, num_layers=1, batch_size=B, max_seq_len=T_max, num_kv_heads=H, head_dim=D)


BOTH = [dict(rotate_keys="hadamard"), dict(rotate_values="random"), dict(rotate_keys="random", rotate_values="hadamard")]


@pytest.mark.parametrize("options", BOTH)
def test_rotation_is_exact_where_nothing_is_quantized(options):
    # 100 tokens < R = 128: every key and value sits in the residual, so attention through the
    # rotated cache must equal plain attention up to fp32 rounding.
    k, v, q = _kv(100)
    layer = _cache(**options).layers[0]
    layer.append(k, v)
    torch.testing.assert_close(layer.attend(q), _sdpa(q, k, v), atol=ATOL, rtol=RTOL)
    keys, values = layer.dequantized()  # in the model's basis
    torch.testing.assert_close(keys, k, atol=ORTHO_ATOL * 10, rtol=0)  # |k| up to ~40: 10x the unit bound
    torch.testing.assert_close(values, v, atol=ORTHO_ATOL, rtol=0)


@pytest.mark.parametrize("options", BOTH)
def test_quantized_rotated_cache_attends_over_what_it_stores(options):
    # 200 tokens, 2 bits: 128 keys and 72 values quantized. Attention equals exact attention over
    # the cache's own contents rotated back (dequantized()), and those are within the quantization
    # error: an orthogonal M keeps each vector's L2 error, at most sqrt(D) * (max scale) / 2.
    k, v, q = _kv(200)
    layer = _cache(**options).layers[0]
    layer.append(k[:, :, :150], v[:, :, :150], Step(prefill=True))
    for t in range(150, 200):
        layer.append(k[:, :, t : t + 1], v[:, :, t : t + 1])
    keys, values = layer.dequantized()
    torch.testing.assert_close(layer.attend(q), _sdpa(q, keys, values), atol=ATOL, rtol=RTOL)
    for stored, exact, scale in ((keys, k, layer.k_scale), (values, v, layer.v_scale)):
        bound = math.sqrt(D) * float(scale.abs().max()) / 2 * (1 + 1e-5)
        assert float((stored - exact).norm(dim=-1).max()) <= bound


def test_cache_bytes_and_state_are_unchanged():
    plain, rotated = _cache(), _cache(rotate_keys="hadamard", rotate_values="random")
    assert rotated.nbytes() == plain.nbytes()
    assert rotated.state().keys() == plain.state().keys()  # the matrices are constants, not state
    assert len(rotated.constants()) == 2
    rotated.reset()  # reset keeps the constants
    torch.testing.assert_close(rotated.layers[0].rot_k @ rotated.layers[0].rot_k.t(), torch.eye(D),
                               atol=ORTHO_ATOL, rtol=0)


def test_paged_rotated_cache_equals_static_bit_for_bit():
    cfg = KIVIConfig(k_bits=2, v_bits=2, group_size=8, residual_length=16, rotate_keys="hadamard",
                     rotate_values="random")
    static, paged, manager = make_pair(cfg, B=B, H=H, D=D, page_size=8, max_pages=8)
    k, v, q = _kv(40, seed=1)
    append_both(static, paged, manager, k[:, :, :20], v[:, :, :20], prefill=True)
    for t in range(20, 40):
        append_both(static, paged, manager, k[:, :, t : t + 1], v[:, :, t : t + 1])
        assert torch.equal(static.layers[0].attend(q), paged.layers[0].attend(q))
    assert paged.layers[0].rot_k is not None and len(paged.constants()) == 2
    from kivi_ops.cache.row_view import leading_rows  # a server's decode bucket: the view keeps the matrices

    view = leading_rows(paged, 1).layers[0]
    assert view.rot_k is paged.layers[0].rot_k and view.rot_v is paged.layers[0].rot_v


class _Step(torch.nn.Module):
    """One decode step of one rotated layer: append, then attend (what a decoder layer does)."""

    def __init__(self, options):
        super().__init__()
        cfg = KIVIConfig(k_bits=2, v_bits=4, group_size=8, residual_length=16, **options)
        self.cache = KIVICache(cfg, num_layers=1, batch_size=B, max_seq_len=48, num_kv_heads=H, head_dim=D)

    def forward(self, key, value, query):
        layer = self.cache.layers[0]
        layer.append(key, value)
        return layer.attend(query)


def _steps(n, seed=2):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(B, H, 1, D, generator=g), torch.randn(B, H, 1, D, generator=g),
             torch.randn(B, HQ, 1, D, generator=g)) for _ in range(n)]


@pytest.mark.slow  # 10-15 s of tracing; test_export_options.py's rotation exports also run in `make test-slow`
@torch.no_grad()
def test_compiled_and_exported_steps_equal_eager():
    options = dict(rotate_keys="hadamard", rotate_values="random")
    inputs = _steps(20)  # 20 tokens from empty: a key flush at 16, values leaving the window
    eager = _Step(options)
    want = [eager(*x) for x in inputs]
    compiled_module = _Step(options)
    compiled = torch.compile(compiled_module, fullgraph=True, backend="aot_eager")
    for x, out in zip(inputs, want):  # the compile-mode forms sum in another order: ATOL
        torch.testing.assert_close(compiled(*x), out, atol=ATOL, rtol=RTOL)
    program = torch.export.export(_Step(options), inputs[0])
    constants = {**dict(program.named_buffers()), **program.constants}
    assert any(torch.equal(t, eager.cache.layers[0].rot_k) for t in constants.values())  # embedded
    module = program.module()
    for x, out in zip(inputs, want):
        torch.testing.assert_close(module(*x), out, atol=ATOL, rtol=RTOL)


# ---------------------------------------------------------------- the fake-quantization baselines


def test_fake_fp8_per_head_error_bound():
    from kivi_benchmarks.perplexity import FP8_MAX, fake_fp8_per_head

    x = torch.randn(2, 3, 50, 64)
    x[0, 1] *= 100  # one head 100x larger: its own scale
    got = fake_fp8_per_head(x)
    scale = x.abs().amax(dim=(-2, -1), keepdim=True) / FP8_MAX
    # e4m3: 3 mantissa bits, relative error <= 2^-4 for normals; below 2^-6 (the smallest normal)
    # the spacing is 2^-9, absolute error <= 2^-10, in units of the head's scale.
    bound = torch.maximum(x.abs() * 2**-4, scale * 2**-10) * (1 + 1e-6)
    assert bool(((got - x).abs() <= bound).all())
    assert torch.equal(fake_fp8_per_head(torch.zeros(1, 1, 4, 8)), torch.zeros(1, 1, 4, 8))


def test_fake_per_token_head_and_bits_per_element():
    from kivi_benchmarks.perplexity import FakeQuantConfig, _fake_int

    x = torch.randn(1, 2, 32, 64)
    got = _fake_int(x, 4, 32, "head")
    scale = (x.amax(-1, keepdim=True) - x.amin(-1, keepdim=True)) / 15  # one group per token per head
    assert bool(((got - x).abs() <= scale / 2 * (1 + 1e-5)).all())
    assert FakeQuantConfig(2, 2, 32, "channel", "token").bits_per_element(64) == 3.0  # KIVI-2: 2 + 32/32
    assert FakeQuantConfig(4, 4, 32, "head", "head").bits_per_element(64) == 4.5  # 4 + 32/64
    assert FakeQuantConfig(8, 8, format="fp8").bits_per_element(64) == 8.0
    with pytest.raises(ValueError, match="k_axis must be one of"):
        FakeQuantConfig(k_axis="row")
    with pytest.raises(ValueError, match="format='fp8' stores 8 bits"):
        FakeQuantConfig(2, 2, format="fp8")
    assert set(ROTATIONS) == {"none", "hadamard", "random"}


def test_table_rows_and_bits_per_element(tmp_path):
    from kivi_benchmarks.quality_table import Row, baseline_rows, bits_per_element, plot_bits, rotation_rows
    from kivi_models import patch_model
    from tiny_models import tiny_llama

    model = patch_model(tiny_llama())  # head_dim 8, 2 layers, 2 KV heads
    rows = {r.name: r for r in rotation_rows() + baseline_rows()}
    assert {"KIVI-2 + rotated K (G=32, R=128)", "KIVI-4 + rotated K+V (G=32, R=128)",
            "fake FP8 e4m3, per-head scale", "fake int2 per token-head, rotated K+V"} <= set(rows)
    kivi2 = Row("KIVI-2", "kivi", "kivi", kivi=KIVIConfig(2, 2, 8, 32))
    rotated = Row("KIVI-2 rotated", "rotation", "kivi", kivi=KIVIConfig(2, 2, 8, 32, rotate_keys="hadamard",
                                                                        rotate_values="random"))
    # Exact bytes at 4K: 2-bit codes + an fp16 scale and zero per 8 keys of a channel and per 8
    # channels of a value = 2 + 32/8 bits, plus the 32-token fp16 residual (32 * 16 / 4096 each)
    # and the int64 lengths (64 bits per layer over 2 x 2 heads x 4096 tokens x 8 channels).
    want = 2 + 32 / 8 + 32 * 16 / 4096 + 64 / (2 * 2 * 4096 * 8)
    assert bits_per_element(model, kivi2) == bits_per_element(model, rotated) == pytest.approx(want, rel=1e-12)
    assert bits_per_element(model, Row("16-bit", "baseline", "fp")) == 16.0
    assert bits_per_element(model, rows["fake int2 per token-head, rotated K+V"]) == 2 + 32 / 8
    report = {"perplexity": [dict(name="16-bit", group="baseline", method="fp", ppl=10.0, bits_per_element=16.0),
                             dict(name="KIVI-2", group="kivi", method="kivi", ppl=12.0, bits_per_element=want)]}
    plot_bits(report, tmp_path / "bits.png", "t")
    assert (tmp_path / "bits.png").stat().st_size > 0
