"""Calibrated rotations (rotate_keys / rotate_values = "calibrated", kivi_ops/calibration/rotations.py):
per layer and KV head matrices chosen offline, stored with the model's identity and refused for
another model; through the cache they keep attention exact where nothing is quantized, cost no
bytes, and the static, paged, compiled, exported and tensor-parallel paths agree."""

import importlib
import json
import math

import pytest
import torch
import torch.nn.functional as F

from kivi_ops import KIVICache, KIVIConfig, Step
from kivi_ops.calibration.nuq import levels_basis
from kivi_ops.calibration.rotations import (CalibratedRotations, candidate_matrices, choose_rotations,
                                            learned_rotation, load_rotations, model_identity, quantization_error,
                                            rotated_activations, rotations_digest, rotations_section)
from kivi_ops.options.rotation import random_orthogonal, rotate, rotation_matrix, unrotate
from paged_helpers import append_both, make_pair
from serve_fixtures import tiny  # noqa: F401
from test_rotation import ATOL, ORTHO_ATOL, RTOL

L, B, H, HQ, D = 2, 2, 2, 4, 64
HF_CONFIG = dict(model_type="llama", hidden_size=128, num_hidden_layers=L, num_attention_heads=HQ,
                 num_key_value_heads=H, head_dim=D, intermediate_size=256, vocab_size=100, rope_theta=10000.0)


def _rotations(layers=L, heads=H, dim=D, seed=0) -> CalibratedRotations:
    """A different seeded random orthogonal matrix per layer, head, keys and values."""
    ms = [random_orthogonal(dim, seed + i) for i in range(2 * layers * heads)]
    keys, values = torch.stack(ms[::2]), torch.stack(ms[1::2])
    return CalibratedRotations(keys.reshape(layers, heads, dim, dim), values.reshape(layers, heads, dim, dim), "test")


CALIBRATED = dict(rotate_keys="calibrated", rotate_values="calibrated")


def _config(rotations=None, **options) -> KIVIConfig:
    return KIVIConfig(k_bits=2, v_bits=2, group_size=32, residual_length=128, **CALIBRATED,
                      rotations=rotations or _rotations(), **options)


def _kv(T, seed=0):
    g = torch.Generator().manual_seed(seed)
    k, v = torch.randn(B, H, T, D, generator=g), torch.randn(B, H, T, D, generator=g)
    k[..., 3] *= 10  # an outlier channel
    return k, v, torch.randn(B, HQ, 1, D, generator=g)


def _sdpa(q, k, v):
    return F.scaled_dot_product_attention(q, k.repeat_interleave(HQ // H, 1), v.repeat_interleave(HQ // H, 1))


# ---------------------------------------------------------------- the matrices and the file


def test_per_head_rotation_uses_each_query_heads_kv_head_matrix():
    m = _rotations().keys[0]  # [H, D, D]
    q = torch.randn(B, HQ, 3, D)
    got = rotate(q, m)
    for h in range(HQ):  # GQA: query head h belongs to KV head h // (HQ / H)
        torch.testing.assert_close(got[:, h], q[:, h] @ m[h // (HQ // H)], atol=ORTHO_ATOL, rtol=0)
    torch.testing.assert_close(unrotate(got, m), q, atol=ORTHO_ATOL, rtol=0)


def test_candidates_are_orthogonal_and_the_choice_is_the_least_error():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 64, D, generator=g) @ torch.randn(D, D, generator=g)  # correlated channels
    for m in candidate_matrices(x).values():
        torch.testing.assert_close(m @ m.T, torch.eye(D), atol=ORTHO_ATOL, rtol=0)
    k = torch.randn(4, H, 64, D, generator=g)
    k[..., 5] *= 20
    acts = [dict(k=k, v=torch.randn(4, H, 64, D, generator=g), k_fisher=torch.ones(4, H, 64, D),
                 v_fisher=torch.ones(4, H, 64, D))]
    chosen = choose_rotations(acts, bits=2, group_size=32)
    for part, axis in (("k", "channel"), ("v", "token")):
        for h, head in enumerate(chosen["layers"][0][part]):
            options = candidate_matrices(acts[0][part][:, h])
            errors = {n: quantization_error(acts[0][part][:, h], acts[0][f"{part}_fisher"][:, h], m, bits=2,
                                            group_size=32, axis=axis) for n, m in options.items()}
            assert head["kind"] == min(errors, key=errors.get)
            assert head["error_vs_identity"][head["kind"]] <= 1.0
            assert torch.equal(head["matrix"], options[head["kind"]])


def _mixed_activations(seed=2, windows=4):
    """Keys and values with channel scales from 0.1 to 10, mixed by a random rotation (so no candidate
    undoes it exactly), and random positive Fisher weights."""
    g = torch.Generator().manual_seed(seed)
    acts = {}
    for part in ("k", "v"):
        acts[part] = torch.randn(windows, H, 64, D, generator=g) * torch.logspace(-1, 1, D) @ random_orthogonal(D, seed)
        acts[f"{part}_fisher"] = torch.rand(windows, H, 64, D, generator=g) + 0.5
    return [acts]


def test_learned_rotation_is_orthogonal_and_lowers_the_held_out_error():
    [acts] = _mixed_activations()
    for part, axis in (("k", "channel"), ("v", "token")):
        x, w = acts[part][:, 0], acts[f"{part}_fisher"][:, 0]
        start = torch.eye(D)
        m, learned, before = learned_rotation(x, w, start, bits=2, group_size=32, axis=axis)
        torch.testing.assert_close(m @ m.T, torch.eye(D), atol=ORTHO_ATOL, rtol=0)
        held = dict(bits=2, group_size=32, axis=axis)
        assert before == quantization_error(x[-1:], w[-1:], start, **held)  # the last quarter is held out
        assert learned == quantization_error(x[-1:], w[-1:], m, **held) < before
    assert learned < 0.8 * before  # per-token values of mixed channels: the rotation re-separates them


def test_choose_rotations_keeps_a_learned_rotation_only_where_it_wins_held_out(tmp_path):
    acts = _mixed_activations()
    chosen = choose_rotations(acts, bits=2, group_size=32, learn=True)
    plain = choose_rotations(acts, bits=2, group_size=32)
    kinds = [h["kind"] for part in ("k", "v") for h in chosen["layers"][0][part]]
    assert "learned" in kinds
    for part, axis in (("k", "channel"), ("v", "token")):
        for h, (head, start) in enumerate(zip(chosen["layers"][0][part], plain["layers"][0][part])):
            x, w = acts[0][part][:, h], acts[0][f"{part}_fisher"][:, h]
            _, learned, before = learned_rotation(x, w, start["matrix"], bits=2, group_size=32, axis=axis)
            assert head["kind"] == ("learned" if learned < before else start["kind"])
            assert set(head["error_vs_identity"]) == {"identity", "hadamard", "pca", "pca_hadamard", "learned"}
    section = rotations_section(chosen, model_identity(dict(HF_CONFIG, num_hidden_layers=1), "tiny"))
    assert section["candidates"][-1] == "learned"
    path = tmp_path / "learned.json"
    path.write_text(json.dumps(dict(format="kivi-nuq-v1", rotations=section)))
    loaded = load_rotations(path, None)
    for h, head in enumerate(chosen["layers"][0]["k"]):
        torch.testing.assert_close(loaded.keys[0, h], head["matrix"])
    with pytest.raises(ValueError, match="hold out a quarter of the calibration windows: give --windows 2"):
        choose_rotations(_mixed_activations(windows=1), bits=2, group_size=32, learn=True)


def test_levels_basis_the_rotated_activations_and_the_nuq_objective():
    g = torch.Generator().manual_seed(1)
    k, v = torch.randn(4, H, 64, D, generator=g), torch.randn(4, H, 64, D, generator=g)
    k[..., 5] *= 20
    grads = dict(k_grad=torch.randn(4, H, 64, D, generator=g), v_grad=torch.randn(4, H, 64, D, generator=g))
    acts = [dict(k=k, v=v, **grads, k_fisher=grads["k_grad"] ** 2, v_fisher=grads["v_grad"] ** 2)]
    chosen = choose_rotations(acts, bits=2, group_size=32, nuq=True)
    [rotated] = rotated_activations(acts, chosen)
    for part in ("k", "v"):
        for h, head in enumerate(chosen["layers"][0][part]):
            m = head["matrix"]
            torch.testing.assert_close(rotated[part][:, h], acts[0][part][:, h] @ m)
            torch.testing.assert_close(rotated[f"{part}_fisher"][:, h], (acts[0][f"{part}_grad"][:, h] @ m) ** 2)
            assert head["error_vs_identity"][head["kind"]] <= 1.0  # the least error of the four, on fitted levels
    section = rotations_section(chosen, model_identity(HF_CONFIG, "tiny"))
    assert section["objective"].endswith("nuq levels fitted to each candidate")
    assert levels_basis("none", "none", None) is None and levels_basis("calibrated", "calibrated", _rotations()) \
        == _rotations().digest
    with pytest.raises(ValueError, match="needs both --rotate-keys calibrated and --rotate-values calibrated"):
        levels_basis("calibrated", "hadamard", _rotations())


def test_levels_are_refused_in_another_basis(tmp_path):
    from kivi_ops.calibration.nuq import load_tables

    levels = [[0.0, 1.0, 2.0, 3.0]] * L
    for stored, used, message in ((None, "abc", "its levels were fitted unrotated, but this cache rotates"),
                                  ("abc", None, "fitted after the file's calibrated rotations \\(sha256 abc\\)"),
                                  ("abc", "def", "fitted after calibrated rotations sha256 abc, but this cache "
                                                 "applies sha256 def")):
        path = tmp_path / f"{stored}.json"
        path.write_text(json.dumps(dict(format="kivi-nuq-v1", num_layers=L, group_size=32, levels_rotations=stored,
                                        bits={"2": dict(k=levels, v=levels)})))
        with pytest.raises(ValueError, match=message):
            load_tables(path, bits=2, num_layers=L, group_size=32, rotations=used)
        assert len(load_tables(path, bits=2, num_layers=L, group_size=32, rotations=stored)["k"]) == L


def test_rotations_digest_is_the_stored_files(tmp_path):
    g = torch.Generator().manual_seed(2)
    acts = [dict(k=torch.randn(2, H, 64, D, generator=g), v=torch.randn(2, H, 64, D, generator=g),
                 k_fisher=torch.ones(2, H, 64, D), v_fisher=torch.ones(2, H, 64, D)) for _ in range(L)]
    chosen = choose_rotations(acts, bits=2, group_size=32)
    path = tmp_path / "calib.json"
    path.write_text(json.dumps(dict(format="kivi-nuq-v1", rotations=rotations_section(chosen, model_identity(HF_CONFIG,
                                                                                                           "tiny")))))
    assert rotations_digest(chosen) == load_rotations(path, None).digest


def _write(path, rotations: CalibratedRotations, hf_config=HF_CONFIG, name="tiny"):
    Lr, Hr = rotations.shape[:2]
    chosen = dict(bits=2, group_size=32, layers=[
        {part: [dict(kind="pca", matrix=getattr(rotations, attr)[i, h], error_vs_identity={}) for h in range(Hr)]
         for part, attr in (("k", "keys"), ("v", "values"))} for i in range(Lr)])
    path.write_text(json.dumps(dict(format="kivi-nuq-v1", rotations=rotations_section(chosen, model_identity(hf_config, name)))))
    return path


def test_file_round_trip_and_refusals_name_the_file_and_field(tmp_path):
    rotations = _rotations()
    path = _write(tmp_path / "calib.json", rotations)
    loaded = load_rotations(path, model_identity(HF_CONFIG, "tiny"))
    assert torch.equal(loaded.keys, rotations.keys) and torch.equal(loaded.values, rotations.values)
    assert loaded == rotations and loaded.source == str(path)
    other_dim = dict(HF_CONFIG, head_dim=32)
    with pytest.raises(ValueError, match=rf"--rotations {path}: rotations.model.head_dim is 64 .* has 32"):
        load_rotations(path, model_identity(other_dim, "other"))
    other_model = dict(HF_CONFIG, vocab_size=101)  # same shapes of the cache, another model
    with pytest.raises(ValueError, match=rf"--rotations {path}: rotations.model.fingerprint"):
        load_rotations(path, model_identity(other_model, "other"))
    with pytest.raises(ValueError, match="rotations.model.num_kv_heads"):
        load_rotations(path, model_identity(dict(HF_CONFIG, num_key_value_heads=1), "other"))
    data = json.loads(path.read_text())
    bad = torch.eye(D) * 2
    data["rotations"]["layers"][1]["v"][0]["matrix"] = rotations_section(
        dict(bits=2, group_size=32, layers=[{"k": [], "v": [dict(kind="pca", matrix=bad, error_vs_identity={})]}]),
        {})["layers"][0]["v"][0]["matrix"]
    (tmp_path / "bad.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"rotations.layers\[1\].v\[0\].matrix is not an orthogonal matrix"):
        load_rotations(tmp_path / "bad.json", None)
    data = json.loads(path.read_text())  # identity and Hadamard are stored by name, rebuilt on load
    data["rotations"]["layers"][0]["k"][1] = dict(kind="hadamard", error_vs_identity={})
    (tmp_path / "named.json").write_text(json.dumps(data))
    named = load_rotations(tmp_path / "named.json", None)
    assert torch.equal(named.keys[0, 1], rotation_matrix("hadamard", D)) and torch.equal(named.keys[1], rotations.keys[1])
    data["rotations"]["keys_pre_rope"] = True  # `kivi calibrate --pre-rope`: keys fitted before RoPE
    (tmp_path / "pre.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match="rotations.keys_pre_rope is true"):
        load_rotations(tmp_path / "pre.json", None)
    load_rotations(tmp_path / "pre.json", None, keys=False)  # its value rotations still apply
    (tmp_path / "levels.json").write_text(json.dumps(dict(format="kivi-nuq-v1")))
    with pytest.raises(ValueError, match="the field 'rotations' .* is missing"):
        load_rotations(tmp_path / "levels.json", None)


def test_config_needs_rotations_exactly_with_the_calibrated_kind():
    with pytest.raises(ValueError, match="'calibrated' needs rotations"):
        KIVIConfig(rotate_keys="calibrated")
    with pytest.raises(ValueError, match="rotations are used only with"):
        KIVIConfig(rotate_keys="hadamard", rotations=_rotations())
    with pytest.raises(ValueError, match="not supported with pre_rope=True"):
        KIVIConfig(pre_rope=True, rotate_keys="calibrated", rotations=_rotations())
    config = _config()
    assert config == _config(_rotations())  # by content
    assert config.to_dict()["rotations"] == dict(file="test", sha256=config.rotations.digest)
    json.dumps(config.to_record())  # reports stay JSON
    with pytest.raises(ValueError, match=r"rotations \(test\) are \[layers=2, kv_heads=2, head_dim=64\], but layer 0 "
                                         r"caches kv_heads=1"):
        KIVICache(_config(), num_layers=L, batch_size=B, max_seq_len=64, num_kv_heads=1, head_dim=D)


# ---------------------------------------------------------------- through the cache


def _cache(config=None, T_max=256):
    return KIVICache(config or _config(), num_layers=L, batch_size=B, max_seq_len=T_max, num_kv_heads=H, head_dim=D)


def test_exact_where_nothing_is_quantized_with_each_layers_own_matrices():
    k, v, q = _kv(100)  # 100 < R: all in the residual
    cache = _cache()
    for i, layer in enumerate(cache.layers):
        assert torch.equal(layer.rot_k, cache.config.rotations.keys[i])
        layer.append(k, v)
        torch.testing.assert_close(layer.attend(q), _sdpa(q, k, v), atol=ATOL, rtol=RTOL)
        keys, values = layer.dequantized()
        torch.testing.assert_close(keys, k, atol=ORTHO_ATOL * 10, rtol=0)
        torch.testing.assert_close(values, v, atol=ORTHO_ATOL, rtol=0)
    assert not torch.equal(cache.layers[0].rot_k, cache.layers[1].rot_k)


def test_quantized_cache_attends_over_what_it_stores_and_costs_no_bytes():
    k, v, q = _kv(200)
    cache = _cache()
    layer = cache.layers[1]
    layer.append(k[:, :, :150], v[:, :, :150], Step(prefill=True))
    for t in range(150, 200):
        layer.append(k[:, :, t : t + 1], v[:, :, t : t + 1])
    keys, values = layer.dequantized()
    torch.testing.assert_close(layer.attend(q), _sdpa(q, keys, values), atol=ATOL, rtol=RTOL)
    for stored, exact, scale in ((keys, k, layer.k_scale), (values, v, layer.v_scale)):
        bound = math.sqrt(D) * float(scale.abs().max()) / 2 * (1 + 1e-5)
        assert float((stored - exact).norm(dim=-1).max()) <= bound
    plain = KIVICache(KIVIConfig(2, 2, 32, 128), num_layers=L, batch_size=B, max_seq_len=256, num_kv_heads=H,
                      head_dim=D)
    assert cache.nbytes() == plain.nbytes()
    assert cache.state().keys() == plain.state().keys()
    assert layer.rot_k.shape == (H, D, D) and len(cache.constants()) == 2 * L


def test_paged_equals_static_bit_for_bit():
    cfg = KIVIConfig(k_bits=2, v_bits=2, group_size=8, residual_length=16, **CALIBRATED,
                     rotations=_rotations(layers=1))
    static, paged, manager = make_pair(cfg, B=B, H=H, D=D, page_size=8, max_pages=8)
    k, v, q = _kv(40, seed=1)
    append_both(static, paged, manager, k[:, :, :20], v[:, :, :20], prefill=True)
    for t in range(20, 40):
        append_both(static, paged, manager, k[:, :, t : t + 1], v[:, :, t : t + 1])
        assert torch.equal(static.layers[0].attend(q), paged.layers[0].attend(q))
    assert torch.equal(paged.layers[0].rot_v, cfg.rotations.values[0])


def test_tensor_parallel_rank_takes_its_heads(monkeypatch):
    generate = importlib.import_module("kivi_models.generate")  # the package exports a function of that name

    config = KIVIConfig(**CALIBRATED, rotations=_rotations(heads=4))
    monkeypatch.setattr(generate, "local_kv_heads", lambda model: 2)
    monkeypatch.setattr(generate, "rank", lambda: 1)
    local = generate.local_kivi_config(None, config)
    assert torch.equal(local.rotations.keys, config.rotations.keys[:, 2:4])
    assert torch.equal(local.rotations.values, config.rotations.values[:, 2:4])
    monkeypatch.setattr(generate, "local_kv_heads", lambda model: 4)
    assert generate.local_kivi_config(None, config) is config


class _Step(torch.nn.Module):
    def __init__(self):
        super().__init__()
        cfg = KIVIConfig(k_bits=2, v_bits=4, group_size=8, residual_length=16, **CALIBRATED,
                         rotations=_rotations(layers=1, seed=5))
        self.cache = KIVICache(cfg, num_layers=1, batch_size=B, max_seq_len=48, num_kv_heads=H, head_dim=D)

    def forward(self, key, value, query):
        layer = self.cache.layers[0]
        layer.append(key, value)
        return layer.attend(query)


@pytest.mark.slow  # ~10 s of tracing
@torch.no_grad()
def test_compiled_and_exported_steps_equal_eager():
    g = torch.Generator().manual_seed(2)
    inputs = [(torch.randn(B, H, 1, D, generator=g), torch.randn(B, H, 1, D, generator=g),
               torch.randn(B, HQ, 1, D, generator=g)) for _ in range(20)]
    eager = _Step()
    want = [eager(*x) for x in inputs]
    compiled = torch.compile(_Step(), fullgraph=True, backend="aot_eager")
    for x, out in zip(inputs, want):
        torch.testing.assert_close(compiled(*x), out, atol=ATOL, rtol=RTOL)
    program = torch.export.export(_Step(), inputs[0])
    constants = {**dict(program.named_buffers()), **program.constants}
    assert any(torch.equal(t, eager.cache.layers[0].rot_k) for t in constants.values())
    module = program.module()
    for x, out in zip(inputs, want):
        torch.testing.assert_close(module(*x), out, atol=ATOL, rtol=RTOL)


# ---------------------------------------------------------------- paged serving, the CLI, TP, export


@pytest.mark.slow  # 5-15 s: a paged engine and five static runs
def test_paged_engine_with_preemptions_equals_static_generate(tiny):
    from kivi_models import generate, make_cache
    from kivi_serve.config import ServeConfig
    from kivi_serve.engine import Engine
    from kivi_serve.paged_options import PagedServing
    from serve_fixtures import LENGTHS, MAX_SEQ_LEN, PROMPTS, complete_all

    model, tokenizer = tiny  # 2 layers, 2 KV heads, head_dim 8
    config = KIVIConfig(group_size=4, residual_length=8, **CALIBRATED, rotations=_rotations(dim=8, seed=9))
    engine = Engine(model, tokenizer, ServeConfig(method="kivi", kivi_config=config, slots=4, max_seq_len=MAX_SEQ_LEN,
                                                  paging=PagedServing(8, 4, None, 256, None), eos_token_ids=set()))
    try:
        got = complete_all(engine, PROMPTS, LENGTHS)
        assert engine.stats()["preemptions"] > 0
    finally:
        engine.close()
    for prompt, n, tokens in zip(PROMPTS, LENGTHS, got):
        ids = tokenizer(prompt)["input_ids"]
        cache = make_cache(model, method="kivi", batch_size=1, max_seq_len=len(ids) + n, kivi_config=config)
        assert tokens == generate(model, [ids], max_new_tokens=n, cache=cache).tokens[0], prompt


@pytest.fixture(scope="module")
def calibrated_tiny(tmp_path_factory):
    """tests/test_parallel.py's tiny Llamas (2 and 4 KV heads, head_dim 16) and a `kivi calibrate`
    file for the first, fitted on a few windows of pydoc."""
    from kivi_cli.main import main
    from test_parallel import write_tiny_dirs

    dirs = write_tiny_dirs(tmp_path_factory)
    out = tmp_path_factory.mktemp("calib") / "calib.json"
    assert main(["calibrate", "--model", str(dirs[2]), "--out", str(out), "--bits", "2", "--group-size", "8",
                 "--window", "64", "--windows", "2"]) == 0
    return dirs, out


def _generate_args(model, calib, *extra):
    return ["generate", "--model", str(model), "--prompt", "The capital of France is", "--max-new-tokens", "20",
            "--method", "kivi", "--group-size", "8", "--residual-length", "8", "--rotate-keys", "calibrated",
            "--rotate-values", "calibrated", "--rotations", str(calib), *extra]


@pytest.mark.slow  # `kivi calibrate` and two `kivi generate` runs on tiny models: 10-30 s
def test_cli_calibrates_then_generates_and_refuses_another_model(calibrated_tiny, capsys):
    from kivi_cli.main import main

    dirs, calib = calibrated_tiny
    section = json.loads(calib.read_text())["rotations"]
    assert section["model"]["num_kv_heads"] == 2 and section["model"]["head_dim"] == 16
    assert len(section["layers"]) == 2 and {h["kind"] for layer in section["layers"] for h in layer["k"] + layer["v"]} \
        <= {"identity", "hadamard", "pca", "pca_hadamard"}
    capsys.readouterr()
    assert main(_generate_args(dirs[2], calib, "--json")) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    kivi = report["config"]["kivi"]
    assert kivi["rotate_keys"] == "calibrated" and kivi["rotations"]["file"] == str(calib)
    with pytest.raises(SystemExit) as e:
        main(_generate_args(dirs[4], calib))
    assert e.value.code == 2
    assert f"--rotations {calib}: rotations.model.num_kv_heads is 2" in capsys.readouterr().err


def test_cli_refuses_calibrated_without_a_file_and_a_file_without_calibrated(capsys):
    from kivi_cli.main import main

    for args, message in ((["--rotate-keys", "calibrated"], "need --rotations PATH"),
                          (["--rotations", "x.json"], "--rotations is used only with"),
                          (["--method", "fp", "--rotate-values", "calibrated", "--rotations", "x.json"],
                           "options of the KIVI cache (--method kivi), not of --method fp")):
        with pytest.raises(SystemExit) as e:
            main(["generate", "--prompt", "x", *args])
        assert e.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.slow  # a compile of the tiny model's decode step
def test_cli_compiled_equals_eager(calibrated_tiny, capsys):
    from kivi_cli.main import main

    dirs, calib = calibrated_tiny
    runs = []
    for extra in ((), ("--compile",)):
        capsys.readouterr()
        assert main(_generate_args(dirs[2], calib, "--json", *extra)) == 0
        runs.append(json.loads(capsys.readouterr().out.strip().splitlines()[-1])["tokens"])
    assert runs[0] == runs[1]


@pytest.mark.slow  # torchrun, 20-30 s
def test_tp2_equals_one_process(calibrated_tiny):
    from test_parallel import kivi

    dirs, calib = calibrated_tiny
    args = _generate_args(dirs[2], calib)
    one, two = kivi(args), kivi(args, nproc=2)  # each rank rotates its own KV head with that head's matrices
    assert two["tokens"] == one["tokens"] and two["tp_size"] == 2


@pytest.mark.slow
def test_pt2_export_equals_generate(tmp_path, capsys):
    from test_export_options import exported_calibrated_config

    kivi, calib = exported_calibrated_config(
        tmp_path, capsys, calibrate_flags=[],
        cache_flags=lambda calib: ["--rotate-keys", "calibrated", "--rotate-values", "calibrated", "--rotations",
                                   str(calib)])
    assert kivi["rotate_keys"] == "calibrated" and kivi["rotations"]["file"] == str(calib)
