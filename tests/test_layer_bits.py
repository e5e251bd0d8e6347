"""Per-layer bit widths (KIVIConfig.layer_bits, kivi_ops/calibration/layer_bits.py): each layer is the uniform
layer of its widths bit for bit and costs its bytes; the widths under a budget follow the measured
sensitivity; the calibration file is refused for another model; the CLI's --layer-bits and --preset;
and the static, paged, compiled, exported and tensor-parallel paths agree."""

import json
from dataclasses import replace

import pytest
import torch

from kivi_ops import KIVICache, KIVIConfig, Step
from kivi_ops.calibration.rotations import load_rotations, model_identity
from kivi_ops.calibration.layer_bits import (choose_widths, layer_bits_section, layer_nbytes, load_layer_bits,
                                             sensitivities)
from kivi_ops.cache.paged import PagedKIVICache
from paged_helpers import ShuffledPages
from serve_fixtures import tiny  # noqa: F401
from test_rotation import ATOL, RTOL

B, H, HQ, D = 2, 2, 4, 64
WIDTHS = ((2, 4), (4, 2), (3, 3))
L = len(WIDTHS)
HF_CONFIG = dict(model_type="llama", hidden_size=128, num_hidden_layers=L, num_attention_heads=HQ,
                 num_key_value_heads=H, head_dim=D, intermediate_size=256, vocab_size=100, rope_theta=10000.0)


def _kv(T, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, H, T, D, generator=g), torch.randn(B, H, T, D, generator=g), torch.randn(B, HQ, 1, D, generator=g)


def _levels(bits, seed=0):
    """2^bits sorted levels in [0, 2^bits - 1], not the uniform grid."""
    g = torch.Generator().manual_seed(seed * 10 + bits)
    inner = torch.rand(2**bits - 2, generator=g).sort().values * (2**bits - 1)
    return tuple(float(v) for v in (0.0, *inner.tolist(), 2.0**bits - 1))


def _nuq_config(config, num_layers=None, layer=None):
    """config with nuq levels per layer at each layer's widths (or, given `layer`, that layer's
    levels at every index, as for_layer builds them)."""
    widths = config.layer_bits or ((config.k_bits, config.v_bits),) * num_layers
    keys = tuple(_levels(k, seed=i) for i, (k, _) in enumerate(widths))
    values = tuple(_levels(v, seed=i + 100) for i, (_, v) in enumerate(widths))
    if layer is not None:
        keys, values = (keys[layer],) * len(keys), (values[layer],) * len(values)
    return replace(config, key_levels=keys, value_levels=values)


def _cache(config, S=128):
    return KIVICache(config, num_layers=config.layer_bits and len(config.layer_bits) or L, batch_size=B,
                     max_seq_len=S, num_kv_heads=H, head_dim=D)


# ---------------------------------------------------------------- the config


def test_config_refuses_bad_widths_naming_them():
    with pytest.raises(ValueError, match=r"layer_bits\[1\] v_bits must be one of \(2, 3, 4, 8\), got 5"):
        KIVIConfig(layer_bits=((2, 2), (2, 5)))
    with pytest.raises(ValueError, match="layer_bits must be a tuple of \\(k_bits, v_bits\\) pairs"):
        KIVIConfig(layer_bits=[(2, 2)])
    with pytest.raises(ValueError, match="layer_bits must be a tuple"):
        KIVIConfig(layer_bits=((2, 2, 2),))
    with pytest.raises(ValueError, match=r"layer_bits\[0\] k_bits=3 packs 8 codes per word .* got group_size=4"):
        KIVIConfig(group_size=4, residual_length=8, layer_bits=((3, 2),))
    with pytest.raises(ValueError, match=r"key_levels\[1\] must be 16 finite floats .* \(for 4-bit codes\)"):
        KIVIConfig(layer_bits=WIDTHS, key_levels=tuple(_levels(b) for b in (2, 2, 3)),
                   value_levels=tuple(_levels(v) for _, v in WIDTHS))
    with pytest.raises(ValueError, match="key_levels has 4 layers, layer_bits 3"):
        KIVIConfig(layer_bits=WIDTHS, key_levels=tuple(_levels(k) for k, _ in WIDTHS) + (_levels(2),),
                   value_levels=tuple(_levels(v) for _, v in WIDTHS))
    nuq = _nuq_config(KIVIConfig(layer_bits=WIDTHS))
    assert nuq.for_layer(1) == _nuq_config(KIVIConfig(k_bits=4, v_bits=2), num_layers=L, layer=1)
    config = KIVIConfig(layer_bits=WIDTHS)
    for cache in (KIVICache, PagedKIVICache):
        extra = dict(max_seq_len=64) if cache is KIVICache else dict(num_pages=4, page_size=32, max_pages_per_seq=2)
        with pytest.raises(ValueError, match=r"layer_bits must have one \(k_bits, v_bits\) pair per layer \(2\), got 3"):
            cache(config, num_layers=2, batch_size=1, num_kv_heads=H, head_dim=D, **extra)
    assert config.for_layer(2) == KIVIConfig(k_bits=3, v_bits=3) and KIVIConfig().for_layer(5) == KIVIConfig()
    json.dumps(config.to_record())


@pytest.mark.parametrize("nuq", [False, True], ids=["uniform grid", "nuq levels per width"])
def test_each_layer_is_the_uniform_layer_of_its_widths_bit_for_bit_and_bytes_add_up(nuq):
    k, v, q = _kv(72)
    with_levels = _nuq_config if nuq else (lambda c, **kw: c)
    mixed = _cache(with_levels(KIVIConfig(group_size=32, residual_length=32, layer_bits=WIDTHS)))
    total = 0
    for i, (kb, vb) in enumerate(WIDTHS):
        uniform = _cache(with_levels(KIVIConfig(k_bits=kb, v_bits=vb, group_size=32, residual_length=32),
                                     num_layers=L, layer=i)).layers[i]
        layer = mixed.layers[i]
        assert layer.params[:2] == (kb, vb)
        if nuq:
            assert layer.levels.k.tolist() == list(_levels(kb, seed=i)) and len(layer.levels.v) == 2**vb
        for lay in (layer, uniform):
            lay.append(k[:, :, :60], v[:, :, :60], Step(prefill=True))
            for t in range(60, 72):  # keys flush at 64
                lay.append(k[:, :, t : t + 1], v[:, :, t : t + 1])
        assert torch.equal(layer.attend(q), uniform.attend(q))
        for a, b in zip(layer.dequantized(), uniform.dequantized()):
            assert torch.equal(a, b)
        assert layer.nbytes() == uniform.nbytes()
        total += uniform.nbytes()
    assert mixed.nbytes() == total
    if not nuq:  # (2,4), (4,2), (3,3): the same code bytes (nuq adds 2^k + 2^v fp32 levels)
        assert len({layer.nbytes() for layer in mixed.layers}) == 1
    assert mixed.layers[0].k_codes.shape[-1] == D * 2 // 8 and mixed.layers[0].v_codes.shape[-1] == D * 4 // 8


@pytest.mark.parametrize("nuq", [False, True], ids=["uniform grid", "nuq levels per width"])
def test_paged_equals_static_with_per_layer_widths(nuq):
    cfg = KIVIConfig(group_size=8, residual_length=16, layer_bits=WIDTHS)
    cfg = _nuq_config(cfg) if nuq else cfg
    S, PS = 64, 8
    static = KIVICache(cfg, num_layers=L, batch_size=B, max_seq_len=S, num_kv_heads=H, head_dim=D)
    paged = PagedKIVICache(cfg, num_layers=L, batch_size=B, num_pages=B * S // PS + 3, page_size=PS,
                           max_pages_per_seq=S // PS, num_kv_heads=H, head_dim=D)
    manager = ShuffledPages(paged)
    assert [layer.page_nbytes() for layer in paged.layers] == [
        PagedKIVICache(KIVIConfig(k, v, 8, 16), num_layers=1, batch_size=B, num_pages=1, page_size=PS,
                       max_pages_per_seq=S // PS, num_kv_heads=H, head_dim=D).page_nbytes() for k, v in WIDTHS]
    k, v, q = _kv(26, seed=1)
    for start, stop in ((0, 12), *((t, t + 1) for t in range(12, 26))):  # keys flush at 16
        manager.reserve([stop - start] * B)
        for cache in (static, paged):
            for layer in cache.layers:
                layer.append(k[:, :, start:stop], v[:, :, start:stop], Step(prefill=start == 0))
        for a, b in zip(static.layers, paged.layers):
            assert torch.equal(a.attend(q), b.attend(q))


class _Step(torch.nn.Module):
    def __init__(self, nuq=False):
        super().__init__()
        cfg = KIVIConfig(group_size=8, residual_length=16, layer_bits=WIDTHS)
        cfg = _nuq_config(cfg) if nuq else cfg
        self.cache = KIVICache(cfg, num_layers=L, batch_size=B, max_seq_len=48, num_kv_heads=H, head_dim=D)

    def forward(self, key, value, query):
        out = []
        for layer in self.cache.layers:
            layer.append(key, value)
            out.append(layer.attend(query))
        return torch.stack(out)


@pytest.mark.slow  # ~15 s of tracing
@pytest.mark.parametrize("nuq", [False, True], ids=["uniform grid", "nuq levels per width"])
@torch.no_grad()
def test_compiled_and_exported_steps_equal_eager(nuq):
    g = torch.Generator().manual_seed(2)
    inputs = [(torch.randn(B, H, 1, D, generator=g), torch.randn(B, H, 1, D, generator=g),
               torch.randn(B, HQ, 1, D, generator=g)) for _ in range(20)]  # 20 tokens: keys flush at 16
    eager = _Step(nuq)
    want = [eager(*x) for x in inputs]
    if nuq:  # the levels change the result: the test would pass without them otherwise
        plain = _Step()
        assert not torch.equal(torch.stack(want), torch.stack([plain(*x) for x in inputs]))
    compiled = torch.compile(_Step(nuq), fullgraph=True, backend="aot_eager")
    for x, out in zip(inputs, want):
        torch.testing.assert_close(compiled(*x), out, atol=ATOL, rtol=RTOL)
    program = torch.export.export(_Step(nuq), inputs[0])
    codes = {name: t.shape[-1] for name, t in program.named_buffers() if name.endswith("codes")}
    assert codes["cache.layers.0.k_codes"] == D * 2 // 8 and codes["cache.layers.1.k_codes"] == D * 4 // 8
    module = program.module()
    for x, out in zip(inputs, want):
        torch.testing.assert_close(module(*x), out, atol=ATOL, rtol=RTOL)


# ---------------------------------------------------------------- the budget


def _sens(errors):
    """sensitivities() of layers whose error at each width is given: {bits: error} per part."""
    return [{"k": dict(zip((2, 3, 4), e[0])), "v": dict(zip((2, 3, 4), e[1]))} for e in errors]


def test_budget_keeps_the_sensitive_parts_wide_and_holds():
    config = KIVIConfig(group_size=64, residual_length=64)
    dims = dict(tokens=4096, num_kv_heads=H, head_dim=D)
    flat = (1.0, 0.5, 0.1)
    sens = _sens([(flat, flat), ((100.0, 10.0, 1.0), flat), (flat, (50.0, 20.0, 1.0)), (flat, flat)])
    full = [True] * 4
    low = 8 * layer_nbytes(config, (2, 2), **dims) / (2 * H * 4096 * D)  # 2.5 + the window
    widths, bits = choose_widths(sens, full, config, budget=low + 0.26, **dims)
    assert bits <= low + 0.26 and widths[1][0] > 2 and widths[2][1] > 2
    assert [w for i, w in enumerate(widths) if i not in (1, 2)] == [(2, 2), (2, 2)]
    assert bits == 8 * sum(layer_nbytes(config, w, **dims) for w in widths) / (2 * 4 * H * 4096 * D)
    widths, bits = choose_widths(sens, full, config, budget=100.0, **dims)
    assert widths == ((4, 4),) * 4
    with pytest.raises(ValueError, match=r"bits_budget=2.5 is below the narrowest cache's 2.7\d+ bits per element"):
        choose_widths(sens, full, config, budget=2.5, **dims)
    widths, bits = choose_widths(sens, [True, False, True, True], config, budget=low + 0.2, **dims)  # one step: 1/6
    assert widths == ((2, 2), (2, 2), (2, 3), (2, 2))  # a sliding-window layer costs nothing and stays narrow


def test_sensitivity_is_the_fisher_weighted_error_and_falls_with_width():
    g = torch.Generator().manual_seed(0)
    act = dict(k=torch.randn(2, H, 64, D, generator=g), v=torch.randn(2, H, 64, D, generator=g))
    act.update(k_fisher=torch.ones(2, H, 64, D), v_fisher=torch.full((2, H, 64, D), 2.0))
    sens = sensitivities([act, dict(act, k_fisher=act["k_fisher"] * 3)], group_size=32)
    for part in ("k", "v"):
        assert sens[0][part][2] > sens[0][part][3] > sens[0][part][4] > 0
    assert sens[1]["k"][2] == pytest.approx(3 * sens[0]["k"][2], rel=1e-5)


def _write(path, widths=WIDTHS, hf_config=HF_CONFIG, group_size=32):
    sens = [{"k": {2: 1.0, 3: 0.5, 4: 0.1}, "v": {2: 1.0, 3: 0.5, 4: 0.1}}] * len(widths)
    section = layer_bits_section(widths, sens, model_identity(hf_config, "tiny"), budget=4.0, bits_per_element=3.9,
                                 tokens=4096, config=KIVIConfig(group_size=group_size), rotated=False,
                                 full=[True] * len(widths))
    path.write_text(json.dumps(dict(format="kivi-nuq-v1", layer_bits=section)))
    return path


def test_file_round_trip_and_refusals(tmp_path):
    path = _write(tmp_path / "c.json")
    widths, section = load_layer_bits(path, model_identity(HF_CONFIG, "tiny"))
    assert widths == WIDTHS and section["group_size"] == 32
    with pytest.raises(ValueError, match=rf"--layer-bits {path}: layer_bits.model.num_kv_heads is 2 .* has 1"):
        load_layer_bits(path, model_identity(dict(HF_CONFIG, num_key_value_heads=1), "other"))
    data = json.loads(path.read_text())
    data["layer_bits"]["layers"][1] = [2, 7]
    (tmp_path / "bad.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"layer_bits is not a valid set of widths \(layer_bits\[1\] v_bits"):
        load_layer_bits(tmp_path / "bad.json", None)
    (tmp_path / "rot.json").write_text(json.dumps(dict(format="kivi-nuq-v1")))
    with pytest.raises(ValueError, match="the field 'layer_bits' .* is missing; re-create the file with `kivi "
                                         "calibrate --bits-budget B`"):
        load_layer_bits(tmp_path / "rot.json", None)


def test_shipped_file_is_within_three_bits_on_the_default_model():
    from kivi_benchmarks.presets import preset_files
    from kivi_models.loading import default_model_dir

    hf_config = json.loads((default_model_dir() / "config.json").read_text())
    [shipped] = preset_files("quality-2bit", "default")
    widths, section = load_layer_bits(shipped, model_identity(hf_config, "default"))
    config = KIVIConfig(group_size=section["group_size"], residual_length=section["residual_length"], layer_bits=widths)
    cache = KIVICache(config, num_layers=len(widths), batch_size=1, max_seq_len=4096, num_kv_heads=3, head_dim=64,
                      dtype=torch.float16, device="meta")
    bits = 8 * cache.nbytes() / (2 * len(widths) * 3 * 4096 * 64)
    assert bits == pytest.approx(section["bits_per_element"], abs=1e-4) and bits <= section["budget"] <= 3.0
    data = json.loads(shipped.read_text())
    assert section["rotated"] and data["rotations"] and data["levels_rotations"] == load_rotations(shipped, None).digest


# ---------------------------------------------------------------- the CLI


def _args(*argv):
    from kivi_cli.main import build_parser

    parser = build_parser()
    args = parser.parse_args(["generate", "--prompt", "x", *argv])
    return args, args.parser


def test_preset_sets_rotations_and_widths_and_refuses_its_flags(capsys):
    from kivi_cli.args import kivi_config_from

    args, parser = _args("--preset", "quality-2bit")
    config = kivi_config_from(args, parser)
    assert config.rotate_keys == config.rotate_values == "calibrated" and len(config.layer_bits) == 30
    assert config.has_nuq and all(len(config.key_levels[i]) == 2**k and len(config.value_levels[i]) == 2**v
                                  for i, (k, v) in enumerate(config.layer_bits))
    assert (config.group_size, config.residual_length, config.sink_tokens) == (64, 64, 4)
    for flags, message in ((["--k-bits", "4"], "--preset quality-2bit sets --k-bits itself"),
                           (["--group-size", "32"], "sets --group-size itself"),
                           (["--rotations", "x.json"], "sets --rotations itself"),
                           (["--layer-bits", "x.json"], "sets --layer-bits itself"),
                           (["--nuq", "x.json"], "sets --nuq itself"),
                           (["--method", "fp"], "--preset is an option of the KIVI cache (--method kivi)"),
                           (["--sink-tokens", "4"], "sets --sink-tokens itself"),
                           (["--pre-rope"], "sets --pre-rope itself"),
                           (["--model", "/nonexistent/hf-model"], "--preset quality-2bit: no shipped calibration for "
                            "--model /nonexistent/hf-model (shipped for --model default (SmolLM2-135M")):
        args, parser = _args("--preset", "quality-2bit", *flags)
        with pytest.raises(SystemExit) as e:
            kivi_config_from(args, parser)
        assert e.value.code == 2 and message in capsys.readouterr().err
    assert "quality-2bit" in parser.format_help()


def test_table_has_a_row_per_shipped_preset_with_the_config_and_bits_eval_reports(tmp_path, monkeypatch, capsys):
    # `kivi eval table`'s preset rows are the caches `--preset NAME` builds, and their bits per
    # element (at 4K tokens) are what `kivi eval ppl --preset NAME --json` reports at a 4K window.
    # The table runs for real on short windows; the eval run's perplexity (a 4K-token forward, 20 s)
    # is stubbed: only its config and bits are compared.
    from kivi_benchmarks import perplexity
    from kivi_benchmarks.quality_table import BYTES_CONTEXTS, preset_rows, run_table
    from kivi_cli.main import main
    from kivi_models import load_model, patch_model

    assert preset_rows(str(tmp_path)) == []  # no shipped calibration
    plain, tokenizer = load_model()
    patched = patch_model(load_model()[0])
    report = run_table(plain, patched, tokenizer, quick=False, out_dir=tmp_path, window=64, windows=1, chunk=8,
                       passkey_lengths=[256], passkey_trials=1, only=["--preset"])
    assert [r["name"] for r in report["perplexity"]] == ["16-bit", "--preset quality-2bit (G=64, R=64)"]
    assert [r["name"] for r in report["passkey"]] == ["16-bit", "--preset quality-2bit (G=64, R=64)"]
    row = report["perplexity"][1]
    assert row["group"] == "preset" and row["config"]["preset"] == "quality-2bit"
    assert "| --preset quality-2bit (G=64, R=64) |" in (tmp_path / "quality.md").read_text()

    monkeypatch.setattr(perplexity, "cache_perplexity",
                        lambda *args, **kwargs: perplexity.PerplexityResult(ppl=1.0, tokens=1, seconds=0.0))
    tokens = BYTES_CONTEXTS[0]
    capsys.readouterr()
    assert main(["eval", "ppl", "--corpus", "pydoc", "--preset", "quality-2bit", "--window", str(tokens),
                 "--max-tokens", str(tokens), "--json"]) == 0
    evaluated = json.loads(capsys.readouterr().out)
    assert evaluated["bits_per_element_tokens"] == tokens
    assert row["bits_per_element"] == evaluated["bits_per_element"] < 3.0
    assert dict(row["config"], preset=None) == dict(evaluated["config"], preset=None)


def test_layer_bits_flag_refuses_explicit_widths_and_another_group_size(tmp_path, capsys):
    from kivi_cli.args import kivi_config_from
    from kivi_models.loading import default_model_dir

    hf_config = json.loads((default_model_dir() / "config.json").read_text())
    path = _write(tmp_path / "c.json", widths=((2, 3),) * 30, hf_config=hf_config)
    args, parser = _args("--layer-bits", str(path))
    assert kivi_config_from(args, parser).layer_bits == ((2, 3),) * 30
    for flags, message in ((["--v-bits", "4"], "--layer-bits sets each layer's widths; leave out --v-bits"),
                           (["--group-size", "64"], "its widths were chosen at --group-size 32"),
                           (["--method", "fp"], "--layer-bits is an option of the KIVI cache")):
        args, parser = _args("--layer-bits", str(path), *flags)
        with pytest.raises(SystemExit) as e:
            kivi_config_from(args, parser)
        assert e.value.code == 2 and message in capsys.readouterr().err


@pytest.fixture(scope="module")
def budget_tiny(tmp_path_factory):
    """tests/test_parallel.py's tiny Llamas and a `kivi calibrate --bits-budget` file for the first."""
    from kivi_cli.main import main
    from test_parallel import write_tiny_dirs

    dirs = write_tiny_dirs(tmp_path_factory)
    out = tmp_path_factory.mktemp("calib") / "calib.json"
    assert main(["calibrate", "--model", str(dirs[2]), "--out", str(out), "--bits", "2", "--group-size", "8",
                 "--window", "64", "--windows", "2", "--bits-budget", "7.2", "--residual-length", "8",
                 "--budget-tokens", "256"]) == 0
    return dirs, out


def _generate_args(model, calib, *extra):
    return ["generate", "--model", str(model), "--prompt", "The capital of France is", "--max-new-tokens", "20",
            "--method", "kivi", "--group-size", "8", "--residual-length", "8", "--layer-bits", str(calib), *extra]


def _eager_and_compiled(args, capsys) -> list[dict]:
    """`kivi generate ARGS --json`, eager then --compile: the two JSON reports."""
    from kivi_cli.main import main

    runs = []
    for extra in ((), ("--compile",)):
        capsys.readouterr()
        assert main([*args, "--json", *extra]) == 0
        runs.append(json.loads(capsys.readouterr().out.strip().splitlines()[-1]))
    return runs


@pytest.mark.slow  # `kivi calibrate` and `kivi generate` runs on tiny models: 20-40 s
def test_cli_calibrates_then_generates_compiled_equal_eager_and_refuses_another_model(budget_tiny, capsys):
    from kivi_cli.main import main

    dirs, calib = budget_tiny
    section = json.loads(calib.read_text())["layer_bits"]
    assert section["bits_per_element"] <= 7.2 and len(section["layers"]) == 2 and section["rotated"]
    runs = _eager_and_compiled(_generate_args(dirs[2], calib), capsys)
    assert runs[0]["tokens"] == runs[1]["tokens"]
    assert runs[0]["config"]["kivi"]["layer_bits"] == section["layers"]
    assert runs[0]["bits_per_element_tokens"] == runs[0]["prompt_tokens"] + 20
    with pytest.raises(SystemExit) as e:
        main(_generate_args(dirs[4], calib))
    assert e.value.code == 2 and "layer_bits.model.num_kv_heads is 2" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["calibrate", "--model", str(dirs[2]), "--out", str(calib.with_name("x.json")), "--group-size", "8",
              "--bits-budget", "6", "--residual-length", "8", "--budget-tokens", "256"])
    assert e.value.code == 2 and "--bits-budget=6.0 is below the narrowest cache's" in capsys.readouterr().err


@pytest.mark.slow  # torchrun, 20-30 s each
@pytest.mark.parametrize("nuq", [False, True], ids=["uniform grid", "nuq levels per width"])
def test_tp2_equals_one_process(nuq, request):
    from test_parallel import kivi

    dirs, calib = request.getfixturevalue("budget_nuq_tiny" if nuq else "budget_tiny")
    args = (_nuq_args if nuq else _generate_args)(dirs[2], calib)
    one, two = kivi(args), kivi(args, nproc=2)
    assert two["tokens"] == one["tokens"] and two["tp_size"] == 2


@pytest.fixture(scope="module")
def budget_nuq_tiny(tmp_path_factory):
    """budget_tiny's models and a file with rotations, nuq2/3/4 levels fitted after them, and widths
    chosen on those levels (--budget-nuq)."""
    from kivi_cli.main import main
    from test_parallel import write_tiny_dirs

    dirs = write_tiny_dirs(tmp_path_factory)
    out = tmp_path_factory.mktemp("calib") / "calib_nuq.json"
    assert main(["calibrate", "--model", str(dirs[2]), "--out", str(out), "--bits", "2,3,4", "--group-size", "8",
                 "--window", "64", "--windows", "2", "--bits-budget", "7.2", "--residual-length", "8",
                 "--budget-tokens", "256", "--budget-nuq"]) == 0
    return dirs, out


def _nuq_args(model, calib, *extra):
    return _generate_args(model, calib, "--nuq", str(calib), "--rotate-keys", "calibrated", "--rotate-values",
                          "calibrated", "--rotations", str(calib), *extra)


@pytest.mark.slow  # `kivi calibrate` and four `kivi generate` runs on tiny models: 20-40 s
def test_cli_nuq_levels_at_each_layers_widths_compiled_equal_eager_and_refused_in_another_basis(budget_nuq_tiny,
                                                                                             capsys):
    from kivi_cli.main import main

    dirs, calib = budget_nuq_tiny
    data = json.loads(calib.read_text())
    assert data["layer_bits"]["nuq"] and data["levels_rotations"] == load_rotations(calib, None).digest
    runs = _eager_and_compiled(_nuq_args(dirs[2], calib), capsys)
    assert runs[0]["tokens"] == runs[1]["tokens"]
    kivi = runs[0]["config"]["kivi"]
    assert kivi["nuq"] == str(calib) and kivi["layer_bits"] == data["layer_bits"]["layers"]
    capsys.readouterr()
    assert main(_generate_args(dirs[2], calib, "--json", "--rotate-keys", "calibrated", "--rotate-values",
                               "calibrated", "--rotations", str(calib))) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["tokens"] != runs[0]["tokens"]
    for extra, message in (((), "its levels were fitted after the file's calibrated rotations"),
                           (("--rotate-keys", "calibrated", "--rotations", str(calib)),
                            "needs both --rotate-keys calibrated and --rotate-values calibrated")):
        with pytest.raises(SystemExit) as e:
            main(_generate_args(dirs[2], calib, "--nuq", str(calib), *extra))
        assert e.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.slow  # 5-15 s: a paged engine leading a TP worker, and five static runs
@pytest.mark.parametrize("nuq", [False, True], ids=["uniform grid", "nuq levels per width"])
def test_paged_tp_engine_with_preemptions_equals_static_generate_and_its_worker(tiny, nuq):
    import functools

    from kivi_models import generate, make_cache
    from kivi_serve.config import ServeConfig
    from kivi_serve.engine import Engine
    from kivi_serve.paged_options import PagedServing
    from kivi_serve.runner import Runner
    from kivi_serve.tp import LeaderRunner
    from serve_fixtures import LENGTHS, MAX_SEQ_LEN, PROMPTS, complete_all
    from test_serve_tp import Loopback, assert_same_cache

    model, tokenizer = tiny  # 2 layers, 2 KV heads, head_dim 8
    config = KIVIConfig(group_size=4, residual_length=8, layer_bits=((2, 4), (4, 2)))
    config = _nuq_config(config) if nuq else config
    args = dict(method="kivi", kivi_config=config, slots=4, max_seq_len=MAX_SEQ_LEN, paging=PagedServing(8, 4))
    channel = Loopback(Runner(model, **args))  # rank 1, replaying rank 0's plans (tests/test_serve_tp.py)
    engine = Engine(model, tokenizer, ServeConfig(**args, eos_token_ids=set()),
                    make_runner=functools.partial(LeaderRunner, channel=channel, timeout_s=60.0))
    try:
        got = complete_all(engine, PROMPTS, LENGTHS, steps_apart=1)
        assert engine.stats()["preemptions"] > 0
    finally:
        engine.close()
    assert_same_cache(engine.runner, channel.runner)
    pages = [layer.page_nbytes() for layer in engine.runner.cache.layers]
    assert pages[0] == pages[1] and engine.runner.cache.layers[0].params[:2] == (2, 4)
    for prompt, n, tokens in zip(PROMPTS, LENGTHS, got):
        ids = tokenizer(prompt)["input_ids"]
        cache = make_cache(model, method="kivi", batch_size=1, max_seq_len=len(ids) + n, kivi_config=config)
        assert tokens == generate(model, [ids], max_new_tokens=n, cache=cache).tokens[0], prompt


@pytest.mark.slow
def test_pt2_export_equals_generate(tmp_path, capsys):
    from test_export_options import exported_calibrated_config

    kivi, calib = exported_calibrated_config(
        tmp_path, capsys, calibrate_flags=["--no-rotations", "--bits-budget", "6.5", "--residual-length", "8",
                                           "--budget-tokens", "512"],
        cache_flags=lambda calib: ["--layer-bits", str(calib)])
    assert kivi["layer_bits"] == json.loads(calib.read_text())["layer_bits"]["layers"]
