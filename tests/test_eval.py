"""Quality harness: perplexity through the cache, fake quantization, passkey prompts, quick table."""

import json

import pytest
import torch

from kivi_benchmarks.passkey import build_prompts
from kivi_benchmarks.perplexity import FakeQuantConfig, cache_perplexity, fake_quant_perplexity
from kivi_models import load_model, patch_model
from kivi_cli.main import main
from kivi_models.corpus import load_text, token_windows
from kivi_ops import KIVIConfig


@pytest.fixture(scope="module")
def models():
    plain, tok = load_model()
    patched, _ = load_model()
    return plain, patch_model(patched), tok


@pytest.fixture(scope="module")
def windows(models):
    return token_windows(models[2], load_text(corpus="pydoc"), window=64, max_tokens=128)


@pytest.mark.slow  # 24 s of the fast suite
def test_fp_and_kivi_with_residual_covering_the_window_give_the_same_ppl(models, windows):
    _, patched, _ = models
    fp = cache_perplexity(patched, windows, method="fp")
    lossless = cache_perplexity(patched, windows, method="kivi", kivi_config=KIVIConfig(residual_length=64))
    quantized = cache_perplexity(patched, windows, method="kivi", kivi_config=KIVIConfig(group_size=8, residual_length=8))
    assert fp.tokens == lossless.tokens == 2 * 63
    # Same keys/values (nothing quantized), different fp32 summation order (SDPA vs online softmax).
    assert lossless.ppl == pytest.approx(fp.ppl, rel=1e-5)
    assert quantized.ppl > fp.ppl * 1.001  # quantization really is on in the same path


def test_fake_16_bit_full_forward_matches_the_cache_path(models, windows):
    plain, patched, _ = models
    full = fake_quant_perplexity(plain, windows, None)
    cached = cache_perplexity(patched, windows, method="fp")
    assert full.ppl == pytest.approx(cached.ppl, rel=1e-4)


def test_fake_quantization_changes_attention_inputs(models, windows):
    plain, _, _ = models
    base = fake_quant_perplexity(plain, windows, None).ppl
    eight = fake_quant_perplexity(plain, windows, FakeQuantConfig(8, 8, 32, "channel", "token")).ppl
    two = fake_quant_perplexity(plain, windows, FakeQuantConfig(2, 2, 32, "channel", "token")).ppl
    assert abs(eight - base) / base < 0.01 < (two - base) / base
    assert plain.config._attn_implementation == "sdpa"  # restored afterwards


def test_passkey_prompts_are_deterministic(models):
    tok = models[2]
    a, b = build_prompts(tok, 300, 3, seed=7), build_prompts(tok, 300, 3, seed=7)
    assert a == b
    assert [p.key for p in build_prompts(tok, 300, 3, seed=8)] != [p.key for p in a]
    for p in a:
        n = len(tok(p.text)["input_ids"])
        assert 250 <= n <= 300 and p.key in p.text


def test_eval_ppl_cli_json(capsys):
    assert main(["eval", "ppl", "--corpus", "pydoc", "--max-tokens", "128", "--window", "64",
                 "--method", "fake", "--k-axis", "token", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert {"ppl", "tokens", "method", "config"} <= set(report)
    assert report["tokens"] == 126 and report["config"]["k_axis"] == "token" and report["ppl"] > 1


@pytest.mark.parametrize("argv,message", [
    (["eval", "ppl", "--corpus", "pydoc", "--window", "48", "--method", "fake"], "multiple of --group-size=32"),
    (["eval", "ppl", "--text", "/nonexistent.txt"], "cannot read --text"),
    (["eval", "passkey", "--lengths", "1k"], "comma-separated integers"),
])
def test_eval_bad_arguments_are_usage_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2 and message in capsys.readouterr().err


# Slow: it runs the quick quality table (minutes) and bounds its runtime, which needs the whole
# machine (make test-slow runs the `timed` tests alone, after the others).
@pytest.mark.slow
@pytest.mark.timed
def test_quick_table_reproduces_the_papers_ordering(tmp_path):
    assert main(["eval", "table", "--quick", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "quality.json").read_text())
    ppl = {r["name"]: r["ppl"] for r in report["perplexity"]}
    kivi_axes = ppl["fake 2-bit K per-channel, V per-token"]
    others = [v for k, v in ppl.items() if k.startswith("fake 2-bit") and "K per-channel, V per-token" not in k]
    assert len(others) == 3 and kivi_axes < min(others)  # KIVI Table 1: K per-channel, V per-token wins
    assert ppl["16-bit"] < ppl["KIVI-2 (G=32, R=32)"] < kivi_axes  # the residual window closes part of the gap
    for name in ("quality.md", "quality_ppl.png", "quality_passkey.png"):
        assert (tmp_path / name).stat().st_size > 0
    assert report["runtime_s"] < 180


def test_table_nuq_rows_take_the_given_models_levels(tmp_path, capsys):
    # `kivi eval table --nuq-levels --kvquant-levels`: the nuq rows read the named files (the
    # committed Gemma 3 270M calibrations, 18 layers) instead of the embedded model's (30 layers).
    from pathlib import Path

    from kivi_benchmarks.quality_table import LevelFiles, kvquant_rows

    results = Path(__file__).resolve().parent.parent / "benchmarks" / "results"
    gemma = LevelFiles(plain=results / "nuq_levels_gemma3.json",
                       full=results / "nuq_levels_gemma3_prerope_sparse1.json")
    for levels, layers, n in ((LevelFiles(), 30, 6), (gemma, 18, 4)):  # Gemma's file has no nuq3: no KVQuant-3 rows
        rows = [r for r in kvquant_rows(levels) if r.kivi.has_nuq]
        assert len(rows) == n and all(len(r.kivi.key_levels) == layers for r in rows)
        assert {r.levels_file for r in rows} == {levels.plain.name, levels.full.name, levels.levels3().name}
        assert len([r for r in rows if r.kivi.k_bits == 3]) == n - 4
    # Levels calibrated without pre-RoPE keys are refused for the KVQuant rows, before any model loads.
    with pytest.raises(SystemExit) as exc:
        main(["eval", "table", "--kvquant-levels", str(gemma.plain), "--out", str(tmp_path)])
    assert exc.value.code == 2 and "--pre-rope" in capsys.readouterr().err
