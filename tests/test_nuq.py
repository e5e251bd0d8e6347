"""KVQuant's nuqX datatype (kivi_ops/calibration/nuq.py) and `kivi calibrate`'s pieces, against direct references."""

import json

import pytest
import torch

from kivi_ops import fake_quantize
from kivi_ops.calibration.nuq import (calibrate_levels, fake_quantize_nuq, nearest_level, uniform_levels,
                                      weighted_error, weighted_kmeans_1d)


@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize("axis", ["channel", "token"])
def test_uniform_levels_reproduce_kivi_fake_quantization(bits, axis):
    # Ties agree too (test_a_value_on_a_midpoint_goes_to_the_upper_level); random data just has none.
    x = torch.randn(2, 3, 64, 64)
    expected = fake_quantize(x, bits, 32, axis)
    torch.testing.assert_close(fake_quantize_nuq(x, bits, 32, axis, uniform_levels(bits)), expected,
                               rtol=0, atol=1e-5)


def test_a_value_on_a_midpoint_goes_to_the_upper_level():
    # One tie rule (packing.nearest_level) for the cache's quantizer, fake quantization and k-means:
    # a value exactly halfway between two levels takes the upper one, like KIVI's round-half-up.
    from kivi_ops.kernels.reference.packing import quantize_pack_reference, unpack

    levels = torch.tensor([0.0, 0.5, 2.0, 3.0])  # midpoints 0.25, 1.25, 2.5, exact in fp32
    # One token-axis group of 32 channels, min 0 and max 3: scale 1 and zero 0 exactly, so the
    # normalized values are the values themselves.
    x = torch.zeros(1, 1, 1, 32)
    x[..., :5] = torch.tensor([0.0, 3.0, 0.25, 1.25, 2.5])
    codes, scale, zero = quantize_pack_reference(x, 2, 32, "token", levels=levels)  # the cache's quantizer
    assert scale.item() == 1.0 and zero.item() == 0.0
    assert unpack(codes, 2)[0, 0, 0, :5].tolist() == [0, 3, 1, 2, 3]
    fake = fake_quantize_nuq(x, 2, 32, "token", levels)
    assert fake[0, 0, 0, :5].tolist() == [0.0, 3.0, 0.5, 2.0, 3.0]
    assert nearest_level(torch.tensor([0.25, 1.25, 2.5]), levels).tolist() == [1, 2, 3]  # k-means assignment
    # The uniform grid's ties (x.5) round up in all three, as in the uniform quantizer.
    x[..., 2:5] = torch.tensor([0.5, 1.5, 2.5])
    uniform = uniform_levels(2)
    codes = quantize_pack_reference(x, 2, 32, "token", levels=uniform)[0]
    assert unpack(codes, 2)[0, 0, 0, :5].tolist() == [0, 3, 1, 2, 3]
    assert torch.equal(fake_quantize_nuq(x, 2, 32, "token", uniform), fake_quantize(x, 2, 32, "token"))
    assert fake_quantize_nuq(x, 2, 32, "token", uniform)[0, 0, 0, 2:5].tolist() == [1.0, 2.0, 3.0]


def test_nuq_matches_a_direct_per_group_reference():
    torch.manual_seed(0)
    x = torch.randn(1, 2, 8, 16)  # keys: groups of 4 tokens per channel
    levels = torch.tensor([0.0, 0.4, 1.7, 3.0])
    out = fake_quantize_nuq(x, 2, 4, "channel", levels)
    for h in range(2):
        for g in range(2):
            for d in range(16):
                group = x[0, h, 4 * g : 4 * g + 4, d]
                lo, scale = group.min(), (group.max() - group.min()) / 3
                for t in range(4):
                    x_n = (group[t] - lo) / scale
                    want = levels[(levels - x_n).abs().argmin()] * scale + lo
                    assert out[0, h, 4 * g + t, d] == pytest.approx(float(want), abs=1e-5)


def test_constant_groups_reconstruct_exactly():
    x = torch.full((1, 1, 32, 8), 0.75)
    assert torch.equal(fake_quantize_nuq(x, 2, 32, "token", torch.tensor([0.0, 0.2, 2.5, 3.0])), x)


def test_bad_levels_are_refused():
    with pytest.raises(ValueError, match="4 levels"):
        fake_quantize_nuq(torch.randn(1, 1, 32, 32), 2, 32, "token", torch.arange(8.0))
    with pytest.raises(ValueError, match="sorted"):
        fake_quantize_nuq(torch.randn(1, 1, 32, 32), 2, 32, "token", torch.tensor([0.0, 2.0, 1.0, 3.0]))


def test_weighted_kmeans_finds_weighted_cluster_means():
    values = torch.tensor([0.0, 0.1, 1.0, 1.2, 5.0, 5.5])
    weights = torch.tensor([1.0, 3.0, 1.0, 1.0, 2.0, 2.0])
    centroids = weighted_kmeans_1d(values, weights, 3, init=torch.tensor([0.0, 2.0, 4.0]))
    torch.testing.assert_close(centroids, torch.tensor([0.075, 1.1, 5.25]))
    assert nearest_level(values, centroids).tolist() == [0, 0, 1, 1, 2, 2]


def test_calibrated_levels_never_lose_to_the_uniform_grid():
    # Heavy-tailed activations, weighted: Lloyd's iterations from the uniform grid only lower the objective.
    torch.manual_seed(0)
    x = torch.distributions.StudentT(3.0).sample((2, 2, 128, 32))
    fisher = torch.rand_like(x)
    levels = calibrate_levels(x, fisher, 2, 32, "channel")
    from kivi_ops.calibration.nuq import normalized_with_weights

    x_n, w = normalized_with_weights(x, fisher, 2, 32, "channel")
    assert weighted_error(x_n, w, levels) < weighted_error(x_n, w, uniform_levels(2))
    assert bool((levels[1:] > levels[:-1]).all())


def test_calibration_records_kv_and_fisher_and_writes_loadable_tables(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    from kivi_models.calibrate import collect_kv_fisher
    from kivi_ops.calibration.nuq import calibrate_tables, load_tables

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2)).eval()
    windows = torch.randint(0, 64, (2, 64))
    acts = collect_kv_fisher(model, windows, batch_size=1)
    assert len(acts) == 2 and acts[0]["k"].shape == (2, 2, 64, 16) and acts[0]["k_fisher"].shape == (2, 2, 64, 16)
    assert all(bool((a["v_fisher"] > 0).any()) for a in acts)  # real gradients reached every layer
    assert not any(p.grad is not None for p in model.parameters())  # no weight gradients
    # The recorded Fisher is the squared gradient of the summed next-token loss: compare layer 1's
    # values with autograd on the v_proj output of a plain forward (window 0).
    outputs = []

    def keep(module, args, out):
        out.retain_grad()
        outputs.append(out)

    handle = model.model.layers[1].self_attn.v_proj.register_forward_hook(keep)
    try:
        model.requires_grad_(False)
        win = windows[:1]
        embeds = model.get_input_embeddings()(win).detach().requires_grad_(True)
        logits = model(inputs_embeds=embeds, use_cache=False).logits[:, :-1]
        torch.nn.functional.cross_entropy(logits.reshape(-1, 64), win[:, 1:].reshape(-1), reduction="sum").backward()
    finally:
        handle.remove()
    grad = outputs[0].grad.view(1, 64, 2, 16).transpose(1, 2)
    torch.testing.assert_close(acts[1]["v_fisher"][:1], grad**2)
    tables = calibrate_tables(acts, bits_list=[2], group_size=32)
    assert len(tables["2"]["k"]) == 2 and all(r <= 1.0 for r in tables["2"]["v_error_vs_uniform"])
    path = tmp_path / "nuq.json"
    path.write_text(json.dumps(dict(format="kivi-nuq-v1", num_layers=2, group_size=32, bits=tables)))
    loaded = load_tables(path, bits=2, num_layers=2, group_size=32)
    assert loaded["k"][0].shape == (4,)
    with pytest.raises(ValueError, match="group_size=32"):
        load_tables(path, bits=2, num_layers=2, group_size=64)
    with pytest.raises(ValueError, match="not 4"):
        load_tables(path, bits=4, num_layers=2, group_size=32)
    with pytest.raises(ValueError, match="2 layers"):
        load_tables(path, bits=2, num_layers=30, group_size=32)


def test_cli_refuses_nuq_where_it_does_not_apply(tmp_path, capsys):
    from kivi_cli.main import main

    with pytest.raises(SystemExit) as e:
        main(["eval", "ppl", "--corpus", "pydoc", "--method", "fp", "--nuq", str(tmp_path / "x.json")])
    assert e.value.code == 2 and "not of --method fp" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["calibrate", "--out", str(tmp_path / "t.json"), "--bits", "5"])
    assert "from 2,3,4" in capsys.readouterr().err


def test_outlier_mask_takes_the_largest_magnitudes_per_vector():
    from kivi_ops.options.dense_sparse import outlier_mask

    x = torch.randn(1, 1, 100, 8)
    x[0, 0, 7, 3] = -50.0  # an outlier of channel 3 (keys: vectors are channels over tokens)
    mask = outlier_mask(x, 0.01, "channel")
    assert mask.sum(dim=-2).tolist() == [[[1] * 8]] and bool(mask[0, 0, 7, 3])
    tok = outlier_mask(x, 0.25, "token")  # values: vectors are tokens, 2 of 8 channels each
    assert bool((tok.sum(dim=-1) == 2).all())
    assert torch.equal(tok, x.abs() >= x.abs().topk(2, dim=-1).values[..., -1:])
    with pytest.raises(ValueError, match=r"\[0, 0.5\)"):
        outlier_mask(x, 0.7, "token")


def test_outlier_selection_orders_by_magnitude_then_lowest_index():
    """One tie rule for every implementation (the Triton append kernels follow it too): larger
    magnitude first, and of equal magnitudes (either sign) the lowest index. topk leaves the
    order of ties unspecified: on CPU [1, 3, 2, 3, 3].topk(2) gives indices [1, 4]."""
    from kivi_ops.options.dense_sparse import select_outliers

    x = torch.tensor([[1.0, 3.0, 2.0, -3.0, 3.0], [0.0, -0.5, 0.5, 4.0, -4.0]])
    mask, vals, idx = select_outliers(x, 3, dim=-1)
    assert idx.tolist() == [[1, 3, 4], [3, 4, 1]] and idx.dtype == torch.int16
    assert vals.tolist() == [[3.0, -3.0, 3.0], [4.0, -4.0, -0.5]]
    assert mask.tolist() == [[False, True, False, True, True], [False, True, False, True, True]]
    _, _, idx = select_outliers(x.T, 2, dim=0)  # along another axis
    assert idx.tolist() == [[1, 3], [3, 4]]


def test_dense_and_sparse_keeps_outliers_exact_and_out_of_the_range():
    from kivi_ops.options.dense_sparse import outlier_mask

    torch.manual_seed(0)
    x = torch.randn(1, 2, 64, 32)
    x[0, 1, 5, 2] = 40.0
    out = fake_quantize_nuq(x, 2, 32, "token", uniform_levels(2), outlier_fraction=1 / 32)
    mask = outlier_mask(x, 1 / 32, "token")
    assert torch.equal(out[mask], x[mask])
    # The rest equals uniform quantization of the group with the outlier removed from its min/max:
    # a direct reference on token (1, 5), whose single group holds all 32 channels.
    row, keep = x[0, 1, 5], ~mask[0, 1, 5]
    lo, hi = row[keep].min(), row[keep].max()
    scale = (hi - lo) / 3
    want = torch.clamp(torch.round((row - lo) / scale), 0, 3) * scale + lo
    torch.testing.assert_close(out[0, 1, 5][keep], want[keep], rtol=0, atol=1e-5)
    # Without outlier removal the 40.0 stretches the range: every other element loses precision.
    plain_err = (fake_quantize_nuq(x, 2, 32, "token", uniform_levels(2))[0, 1, 5] - row)[keep].abs().mean()
    assert (out[0, 1, 5] - row)[keep].abs().mean() < plain_err / 4


def test_undo_rope_inverts_the_models_rope():
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    from kivi_ops.options.rope import apply_rope, undo_rope

    rotary = LlamaRotaryEmbedding(LlamaConfig(hidden_size=64, num_attention_heads=2, max_position_embeddings=256))
    k = torch.randn(1, 2, 40, 32, dtype=torch.float64)
    cos, sin = rotary(k.float(), torch.arange(40)[None])
    cos, sin = cos[:, None].double(), sin[:, None].double()
    _, rotated = apply_rotary_pos_emb(k, k, cos[:, 0], sin[:, 0])  # transformers' own RoPE
    torch.testing.assert_close(apply_rope(k, cos, sin), rotated)
    torch.testing.assert_close(undo_rope(rotated, cos, sin), k)


def test_pre_rope_fake_quantization_quantizes_unrotated_keys():
    from transformers import LlamaConfig, LlamaForCausalLM

    from kivi_benchmarks.perplexity import FakeQuantConfig, fake_quant_perplexity

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2)).eval()
    windows = torch.randint(0, 64, (2, 64))
    exact = fake_quant_perplexity(model, windows, None).ppl
    spec8 = FakeQuantConfig(8, 8, 32)
    # 8 bits before RoPE: still near exact (the rotation is undone and redone exactly).
    assert fake_quant_perplexity(model, windows, spec8, pre_rope=True).ppl == pytest.approx(exact, rel=1e-3)
    spec2 = FakeQuantConfig(2, 2, 32)
    assert fake_quant_perplexity(model, windows, spec2, pre_rope=True).ppl != fake_quant_perplexity(
        model, windows, spec2).ppl
