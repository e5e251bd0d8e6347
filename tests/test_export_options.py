"""Exports with the cache's options (sink and OTT tokens, KVQuant's, OTT's flush policy, rotations):
greedy tokens equal `kivi generate`'s with the same options, through the CLI as a user runs it.

The model is a random 2-layer Llama GGUF (tests/gguf_files.py): what these tests check, the cache's
options inside an exported graph, does not depend on depth, and the embedded model's 30 layers made
each AOTInductor and ExecuTorch export minutes long. test_export.py exports the embedded model."""

import json

import pytest

from gguf_files import LAYERS, write_tiny_llama_gguf
from kivi_cli.main import main
from test_export import CONFIG, NEW_TOKENS, PROMPT, cli_json


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny") / "tiny-llama.gguf"
    write_tiny_llama_gguf(path)
    return ["--model", str(path)]


def exported_kivi_config(fmt, options, out, capsys) -> dict:
    """`kivi export` with `options`, then `kivi run-exported`: its greedy tokens equal `kivi generate`'s
    with the same options. Returns the KIVI config the artifact reports."""
    want = cli_json(["generate", "--prompt", PROMPT, "--max-new-tokens", NEW_TOKENS, "--json", *options], capsys)
    assert main(["export", "--format", fmt, "--out", str(out), "--max-seq-len", "64", *options]) == 0
    capsys.readouterr()
    report = cli_json(["run-exported", str(out), "--prompt", PROMPT, "--max-new-tokens", NEW_TOKENS, "--json"], capsys)
    assert report["tokens"] == want["tokens"]
    return report["config"]["kivi"]


def exported_calibrated_config(tmp_path, capsys, *, calibrate_flags, cache_flags) -> tuple[dict, object]:
    """A tiny GGUF Llama calibrated (`kivi calibrate --bits 2 --group-size 8 --window 64 --windows 2`
    and calibrate_flags), then exported to pt2 with `--method kivi --group-size 8 --residual-length 8`
    and cache_flags(the calibration file), checked as exported_kivi_config does. Returns the KIVI
    config the artifact reports and the calibration file."""
    gguf = tmp_path / "tiny-llama.gguf"
    write_tiny_llama_gguf(gguf)
    calib = tmp_path / "calib.json"
    assert main(["calibrate", "--model", str(gguf), "--out", str(calib), "--bits", "2", "--group-size", "8",
                 "--window", "64", "--windows", "2", *calibrate_flags]) == 0
    options = ["--model", str(gguf), "--method", "kivi", "--group-size", "8", "--residual-length", "8",
               *cache_flags(calib)]
    return exported_kivi_config("pt2", options, tmp_path / "p", capsys), calib


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["pt2", "onnx"])
def test_export_with_sink_and_outlier_tokens(fmt, model, tmp_path, capsys):
    # Sink 1 + OTT 3 outliers in every layer, G=R=8: 16 new tokens flush and pick outliers in-graph.
    options = [*model, *CONFIG, "--sink-tokens", "1", "--outlier-tokens", "3", "--outlier-skip-layers", "0"]
    kivi = exported_kivi_config(fmt, options, tmp_path / "p", capsys)
    assert kivi["outlier_tokens"] == 3 and kivi["sink_tokens"] == 1


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["pt2", "onnx"])
def test_export_with_kvquant_options(fmt, model, tmp_path, capsys):
    # pre-RoPE keys, nuq levels and 10% dense-and-sparse outliers (plus a sink), G=R=8: the new
    # tokens flush key windows, pick outliers and rotate keys in-graph.
    levels = {"2": {"k": [[0.1, 1.1, 1.9, 2.9]] * LAYERS, "v": [[0.0, 0.9, 2.2, 3.0]] * LAYERS}}
    nuq = tmp_path / "levels.json"
    nuq.write_text(json.dumps(dict(format="kivi-nuq-v1", num_layers=LAYERS, group_size=8, pre_rope=True,
                                   sparse_outliers=0.1, bits=levels)))
    options = [*model, *CONFIG, "--pre-rope", "--sparse-outliers", "0.1", "--nuq", str(nuq), "--sink-tokens", "1"]
    kivi = exported_kivi_config(fmt, options, tmp_path / "program", capsys)
    assert kivi["pre_rope"] and kivi["sparse_outliers"] == 0.1


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["pt2", "onnx", "aoti", "pte"])
def test_export_with_ott_flush_policy(fmt, model, tmp_path, capsys):
    # OTT's own schedule with its outlier pool in every layer, G=8, R=3 (not a multiple of G): the
    # 16 new tokens complete groups at lengths 11, 19 (and the prompt's), in-graph, with OTT steps.
    if fmt == "pte":
        pytest.importorskip("executorch.runtime")
    options = [*model, "--flush-policy", "ott", "--group-size", "8", "--residual-length", "3", "--outlier-tokens", "2",
               "--outlier-skip-layers", "0"]
    kivi = exported_kivi_config(fmt, options, tmp_path / "p", capsys)
    assert kivi["flush_policy"] == "ott" and kivi["residual_length"] == 3


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["pt2", "onnx"])
def test_export_with_rotation(fmt, model, tmp_path, capsys):
    # Keys rotated by Walsh–Hadamard, values by a seeded random orthogonal matrix, G=R=8: the
    # exported program carries both matrices as constants and rotates the query, the new keys and
    # values and the attention output in-graph; greedy tokens equal `kivi generate`'s.
    options = [*model, *CONFIG, "--rotate-keys", "hadamard", "--rotate-values", "random", "--rotation-seed", "7"]
    kivi = exported_kivi_config(fmt, options, tmp_path / "p", capsys)
    assert (kivi["rotate_keys"], kivi["rotate_values"], kivi["rotation_seed"]) == ("hadamard", "random", 7)
