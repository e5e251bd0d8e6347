"""User mistakes at the CLI: one clear line naming the flag or file, exit 2 (usage) or 1
(environment), never a traceback; --debug shows it. Silent nonsense refused."""

from __future__ import annotations

import json
import math

import pytest
import torch

from kivi_cli import args as cli_args
from kivi_cli.main import main

PROMPT = ["--prompt", "The capital of France is"]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """A tiny random Llama (2 layers, 256 positions) with the default model's tokenizer."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from kivi_models.loading import default_model_dir

    tokenizer = AutoTokenizer.from_pretrained(default_model_dir(), local_files_only=True)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, vocab_size=len(tokenizer), max_position_embeddings=64)
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny_llama")
    LlamaForCausalLM(config).eval().save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def run(argv, capsys):
    """(exit code, stdout, stderr) of `kivi argv`."""
    try:
        code = main(argv)
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    assert "Traceback" not in err, err
    return code, out, err


@pytest.mark.parametrize("argv, message", [
    (["generate", "--prompt", ""], "--prompt is empty"),
    (["generate", *PROMPT, "--temperature", "nan"], "--temperature must be a finite number"),
    (["generate", *PROMPT, "--temperature", "inf"], "--temperature must be a finite number"),
    (["generate", *PROMPT, "--temperature", "-1"], "--temperature must be a finite number"),
    (["generate", *PROMPT, "--top-p", "nan"], "--top-p must be in (0, 1]"),
    (["generate", *PROMPT, "--method", "fp", "--k-bits", "4"], "--k-bits: options of the KIVI cache"),
    (["generate", *PROMPT, "--method", "fp", "--group-size", "64", "--residual-length", "64"],
     "--group-size / --residual-length: options of the KIVI cache"),
    (["generate", *PROMPT, "--residual-length", "20"], "--residual-length must be a positive multiple of --group-size"),
    (["calibrate", "--out", "x.json", "--no-rotations", "--learned-rotations"],
     "--learned-rotations chooses the rotations; leave out --no-rotations"),
    (["calibrate", "--out", "x.json", "--learned-rotations", "--windows", "1"],
     "--learned-rotations holds out a quarter of the calibration windows: give --windows 2 or more"),
    (["calibrate", "--out", "x.json", "--no-rotations", "--rotations-nuq"],
     "--rotations-nuq chooses the rotations; leave out --no-rotations"),
])
def test_usage_mistakes_are_one_line_and_exit_2(argv, message, capsys):
    code, _, err = run(argv, capsys)
    assert code == 2 and message in err, err


def test_prompt_files(tmp_path, capsys):
    empty = tmp_path / "empty.txt"
    empty.write_text("\n")
    binary = tmp_path / "binary.txt"
    binary.write_bytes(b"\xff\xfe\x00\x81 not text")
    blank = tmp_path / "blank.txt"
    blank.write_text("first prompt\n\nthird prompt\n")
    for argv, message in ((["--prompt-file", str(empty)], "is empty"),
                          (["--batch-file", str(binary)], "is not UTF-8 text"),
                          (["--batch-file", str(tmp_path / "missing.txt")], "cannot read --batch-file"),
                          (["--batch-file", str(blank)], "line(s) 2 are blank")):
        code, _, err = run(["generate", *argv], capsys)
        assert code == 2 and message in err, (argv, err)


def test_a_byte_order_mark_is_not_part_of_the_prompt(tmp_path):
    # Windows editors start UTF-8 files with U+FEFF: read as utf-8-sig, it changes no prompt.
    import argparse

    prompt_file, batch_file = tmp_path / "prompt.txt", tmp_path / "batch.txt"
    prompt_file.write_bytes(b"\xef\xbb\xbfThe capital of France is\n")
    batch_file.write_bytes(b"\xef\xbb\xbffirst prompt\r\nsecond prompt\r\n")
    def read(**files):
        args = argparse.Namespace(**{"prompt": None, "prompt_file": None, "batch_file": None, **files})
        return cli_args.read_prompts(args, argparse.ArgumentParser())

    assert read(prompt_file=str(prompt_file)) == ["The capital of France is"]
    assert read(batch_file=str(batch_file)) == ["first prompt", "second prompt"]


@pytest.mark.parametrize("flag", ["--seed", "--rotation-seed"])
def test_a_seed_torch_cannot_take_is_refused_before_loading(flag, capsys):
    for bad in (str(2**70), str(2**64), str(-(2**63) - 1)):
        code, _, err = run(["generate", *PROMPT, flag, bad], capsys)
        assert code == 2 and f"argument {flag}: must be an integer in [-2**63, 2**64)" in err and "Loading" not in err, err
    assert cli_args.seed_int(str(2**64 - 1)) == 2**64 - 1 and cli_args.seed_int(str(-(2**63))) == -(2**63)


def test_a_model_cache_that_is_a_file_is_refused_before_converting(tmp_path, monkeypatch, capsys):
    taken = tmp_path / "not-a-dir"
    taken.write_text("mine")
    for cache in (taken, taken / "sub"):
        monkeypatch.setenv("KIVI_MODEL_CACHE", str(cache))
        code, _, err = run(["generate", *PROMPT], capsys)
        assert code == 1 and "KIVI_MODEL_CACHE" in err and "is not a directory" in err and "Converting" not in err, err
    assert taken.read_text() == "mine"


@pytest.mark.parametrize("content, message", [
    ("[1, 2, 3]", "not a `kivi calibrate` file"),
    ('{"format": "kivi-nuq-levels/1"}', "is missing"),
    ("not json", "cannot read a calibration file"),
])
def test_malformed_nuq_files(tmp_path, capsys, content, message):
    from kivi_ops.calibration.nuq import FORMAT

    path = tmp_path / "levels.json"
    path.write_text(content.replace("kivi-nuq-levels/1", FORMAT))
    code, _, err = run(["generate", *PROMPT, "--nuq", str(path)], capsys)
    assert code == 2 and message in err, err


def test_nuq_file_with_string_levels_or_wrong_layer_count(tmp_path, capsys):
    from kivi_ops.calibration.nuq import load_tables

    good = json.loads((cli_args.Path(__file__).parents[1] / "benchmarks/results/nuq_levels_smollm2.json").read_text())
    bits = next(iter(good["bits"]))
    strings = dict(good, bits={bits: {"k": [["a", "b"]] * good["num_layers"], "v": good["bits"][bits]["v"]}})
    short = dict(good, bits={bits: {"k": good["bits"][bits]["k"][:3], "v": good["bits"][bits]["v"]}})
    for data, message in ((strings, "levels must be lists of numbers"), (short, "must be a list of levels per layer")):
        path = tmp_path / "levels.json"
        path.write_text(json.dumps(data))
        with pytest.raises(ValueError, match=message):
            load_tables(path, bits=int(bits), num_layers=good["num_layers"], group_size=good["group_size"],
                        pre_rope=good.get("pre_rope", False), sparse_outliers=good.get("sparse_outliers", 0.0))


def nuq_file(path, tiny_dir, **edits):
    """A `kivi calibrate` file for tiny_dir (2 layers, head_dim 16; an absolute path, as the file
    records it) at G=32, 2 bits, with edits."""
    from kivi_ops.calibration.nuq import FORMAT

    good = [0.1, 1.1, 1.9, 2.9]
    data = dict(format=FORMAT, model=str(tiny_dir), num_layers=2, head_dim=16, group_size=32,
                bits={"2": {"k": [good, good], "v": [good, good]}})
    path.write_text(json.dumps({**data, **edits}))
    return path


@pytest.mark.parametrize("levels, message", [
    ([0.5, 0.5, 0.5, 0.5], "bits 2 'k' layer 1: the levels must be 4 finite floats in ascending order, strictly "
                           "increasing, within [0, 3]"),
    ([-1e30, 0.0, 1.0, 1e30], "within [0, 3]"),
    ([0.0, 1.0, 2.0, 1e300 * 10], "strictly increasing"),  # inf: json.dumps writes Infinity
    ([0.0, 1.0, 2.0], "4 finite floats"),
])
def test_degenerate_nuq_levels_are_refused_naming_the_file(levels, message, tiny_dir, tmp_path, capsys):
    good = [0.1, 1.1, 1.9, 2.9]
    path = nuq_file(tmp_path / "levels.json", tiny_dir, bits={"2": {"k": [good, levels], "v": [good, good]}})
    code, _, err = run(["generate", *PROMPT, "--model", str(tiny_dir), "--nuq", str(path)], capsys)
    assert code == 2 and f"--nuq {path}: " in err and message in err and "Loading" not in err, err


def test_a_nuq_file_for_another_model_is_refused_naming_the_field(tiny_dir, tmp_path, capsys):
    path = tmp_path / "levels.json"
    for edits, field in ((dict(model="default"), "model"), (dict(head_dim=64), "head_dim")):
        nuq_file(path, tiny_dir, **edits)
        code, _, err = run(["generate", *PROMPT, "--model", str(tiny_dir), "--nuq", str(path)], capsys)
        assert code == 2 and f"--nuq {path}: calibrated for {field} " in err and "Loading" not in err, err
    nuq_file(path, tiny_dir)  # the matching file is used
    code, out, err = run(["generate", *PROMPT, "--model", str(tiny_dir), "--nuq", str(path), "--max-new-tokens", "2",
                          "--json"], capsys)
    assert code == 0 and json.loads(out)["new_tokens"] == 2, err


def test_broken_model_directories_exit_1(tmp_path, tiny_dir, capsys):
    import shutil

    corrupt = tmp_path / "corrupt"
    shutil.copytree(tiny_dir, corrupt)
    (corrupt / "config.json").write_text("{ not json")
    no_weights = tmp_path / "no_weights"
    shutil.copytree(tiny_dir, no_weights)
    (no_weights / "model.safetensors").unlink()
    truncated = tmp_path / "truncated"
    shutil.copytree(tiny_dir, truncated)
    weights = truncated / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    for path in (corrupt, no_weights, truncated, tmp_path / "nothing"):
        code, _, err = run(["generate", *PROMPT, "--model", str(path)], capsys)
        assert code in (1, 2) and "--model" in err, (path, err)
        assert code == 1 or "is not one" in err  # a directory without config.json is a usage error


@pytest.mark.parametrize("name", ["missing.gguf", "missing", "missing.GGUF"])
def test_a_model_path_that_does_not_exist_is_a_usage_error(name, tmp_path, capsys):
    code, _, err = run(["generate", *PROMPT, "--model", str(tmp_path / name)], capsys)
    assert code == 2 and "--model" in err and "(it does not exist)" in err, err


def test_debug_shows_the_traceback(tmp_path):
    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    (corrupt / "config.json").write_text("{ not json")
    with pytest.raises(OSError):
        main(["generate", *PROMPT, "--model", str(corrupt), "--debug"])


def test_outlier_skip_layers_covering_the_model_is_a_usage_error(tiny_dir, capsys):
    code, _, err = run(["generate", *PROMPT, "--model", str(tiny_dir), "--outlier-tokens", "2",
                        "--outlier-skip-layers", "2"], capsys)
    assert code == 2 and "--outlier-skip-layers" in err, err


def test_context_is_checked_unless_the_user_opts_in(tiny_dir, capsys):
    argv = ["generate", *PROMPT, "--model", str(tiny_dir), "--max-new-tokens", "1000000"]
    code, _, err = run(argv, capsys)
    assert code == 2 and "exceeds the model's context of 64 tokens" in err and "--allow-beyond-context" in err, err


def test_memory_is_checked_before_allocating(tiny_dir, capsys, monkeypatch):
    monkeypatch.setattr(cli_args, "available_memory", lambda device: 1000)
    code, _, err = run(["generate", *PROMPT, "--model", str(tiny_dir), "--max-new-tokens", "8"], capsys)
    assert code == 1 and "needs" in err and "GiB is free" in err, err


def test_non_finite_weights_stop_with_an_error(tmp_path, tiny_dir, capsys):
    import shutil

    from safetensors.torch import load_file, save_file

    broken = tmp_path / "nan_weights"
    shutil.copytree(tiny_dir, broken)
    weights = load_file(broken / "model.safetensors")
    name = next(n for n in weights if n.endswith("o_proj.weight"))
    weights[name][0, 0] = float("nan")
    save_file(weights, broken / "model.safetensors", metadata={"format": "pt"})
    code, out, err = run(["generate", *PROMPT, "--model", str(broken), "--max-new-tokens", "4"], capsys)
    assert code == 1 and "non-finite logits" in err and "the prompt" in err, err


def test_json_has_no_bare_nan(tiny_dir, capsys):
    # One new token: no timed decode step, so decode tokens/s is undefined -> null.
    code, out, _ = run(["generate", *PROMPT, "--model", str(tiny_dir), "--max-new-tokens", "1", "--json"], capsys)
    assert code == 0
    report = json.loads(out, parse_constant=lambda c: pytest.fail(f"bare {c} in the JSON"))
    assert report["decode_tokens_per_s"] is None


def test_dumps_json_maps_non_finite_floats_to_null():
    text = cli_args.dumps_json({"a": math.nan, "b": [1.0, math.inf], "c": {"d": -math.inf}, "e": 2})
    assert json.loads(text) == {"a": None, "b": [1.0, None], "c": {"d": None}, "e": 2}


def test_sampling_flags_with_greedy_decoding_warn(tiny_dir, capsys):
    code, _, err = run(["generate", *PROMPT, "--model", str(tiny_dir), "--max-new-tokens", "2", "--top-k", "5"], capsys)
    assert code == 0 and "--top-k / --top-p have no effect with greedy decoding" in err


def test_export_checks_out_before_loading_the_model(tmp_path, capsys):
    target = tmp_path / "a_file"
    target.write_text("mine")
    code, _, err = run(["export", "--out", str(target), "--format", "pt2"], capsys)
    assert code == 2 and "is a file" in err and "Loading" not in err, err
    assert target.read_text() == "mine"


def test_serve_usage_errors(tiny_dir, capsys):
    for argv, message in ((["--port", "0"], "--port must be in 1..65535"),
                          (["--max-seq-len", "100"], "exceeds the model's context of 64 tokens"),
                          (["--no-paged", "--cache-budget-gib", "0.000001", "--max-seq-len", "32"], "does not hold one row"),
                          *((["--cache-budget-gib", bad], f"argument --cache-budget-gib: must be a finite number > 0, "
                              f"got {bad}") for bad in ("nan", "inf", "-1", "0")),
                          (["--paged", "--cache-budget-gib", "nan"], "argument --cache-budget-gib: must be a finite"),
                          (["--api-key", "clé"], "--api-key (or KIVI_API_KEY) must be printable ASCII"),
                          (["--api-key", "two words"], "--api-key (or KIVI_API_KEY) must be printable ASCII"),
                          (["--max-connections", "100000000"], "--max-connections 100000000 exceeds what the "
                           "descriptor limit allows"),
                          (["--read-timeout", "0"], "argument --read-timeout: must be a finite number > 0"),
                          (["--timeout-keep-alive", "nan"], "argument --timeout-keep-alive: must be a finite"),
                          (["--no-paged", "--max-batch", "2", "--cache-budget-gib", "1"], "not allowed with argument"),
                          (["--no-paged", "--num-pages", "4"], "--num-pages applies only with --paged"),
                          (["--no-paged", "--page-size", "8"], "--page-size applies only with --paged"),
                          (["--paged", "--num-pages", "4", "--cache-budget-gib", "1"], "exclude each other"),
                          (["--paged", "--method", "fp", "--cache-budget-gib", "0.000001", "--max-seq-len", "32"],
                           "does not hold the state of 32 rows"),
                          (["--no-paged", "--prefix-caching"], "--prefix-caching needs --paged"),
                          (["--no-prefix-caching", "--prefix-chunk", "8"], "--prefix-chunk applies only with --prefix-caching"),
                          (["--paged", "--no-prefix-caching", "--prefix-cache-size", "8"],
                           "--prefix-cache-size applies only with --prefix-caching"),
                          (["--no-paged", "--prefix-cache-size", "8"], "--prefix-cache-size applies only with --paged"),
                          (["--no-paged", "--decode-buckets", "4"], "--decode-buckets applies only with --paged"),
                          (["--paged", "--decode-buckets", "4,x"], "must be positive integers separated by commas"),
                          (["--paged", "--decode-buckets", "0"], "must be positive integers"),
                          (["--paged", "--method", "fp", "--num-pages", "8", "--max-seq-len", "32", "--max-batch", "4",
                            "--decode-buckets", "2,6"], "--decode-buckets must be row counts in [1, 4] (--max-batch)"),
                          (["--paged", "--method", "fp", "--num-pages", "8", "--max-seq-len", "32",
                            "--prefix-caching", "--prefix-chunk", "24"],
                           "--prefix-chunk must be a positive multiple of the page size (16 tokens")):
        code, _, err = run(["serve", "--model", str(tiny_dir), *argv], capsys)
        assert code == 2 and message in err, (argv, err)


def test_prefix_cache_gib_is_checked(tiny_dir, capsys):
    for argv, message in ((["--prefix-cache-gib", "0"], "argument --prefix-cache-gib: must be a finite number > 0"),
                          (["--prefix-cache-gib", "nan"], "argument --prefix-cache-gib: must be a finite number > 0"),
                          (["--no-paged", "--prefix-cache-gib", "1"], "--prefix-cache-gib applies only with --paged"),
                          (["--paged", "--no-prefix-caching", "--prefix-cache-gib", "1"],
                           "--prefix-cache-gib applies only with --prefix-caching"),
                          (["--paged", "--max-seq-len", "64", "--prefix-cache-gib", "1e-9"],
                           "holds no cached prefix of the longest prompts")):
        code, _, err = run(["serve", "--model", str(tiny_dir), *argv], capsys)
        assert code == 2 and message in err, (argv, err)
