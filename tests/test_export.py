"""Export round trips on the default model: every format's greedy tokens equal `kivi generate`'s.

The config quantizes within the short run (G=8, R=8), so the exported cache math is exercised,
not only the full-precision residual window. The default model's exports (a minute or more each)
run in `make test-slow`; the artifact checks of `make test` use a pt2 export of a random 2-layer
Llama GGUF (tests/gguf_files.py), and test_three_bit.py's pt2 round trips run there too.
"""

import json
import subprocess
import sys
import zipfile

import pytest
import torch

from kivi_export.artifact import METADATA_FILE, ArtifactError, read_metadata
from kivi_export.decoder import ExportableDecoder
from kivi_export.formats import check_pt2_has_no_pickles
from kivi_cli.main import main

PROMPT = "The capital of France is"
CONFIG = ["--group-size", "8", "--residual-length", "8"]
NEW_TOKENS = "16"


def cli_json(argv, capsys):
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def eager_tokens():
    from kivi_cli.main import main as cli_main

    # A subprocess-free run of `kivi generate --json` (its stdout is the last line).
    import contextlib
    import io

    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        assert cli_main(["generate", "--prompt", PROMPT, "--max-new-tokens", NEW_TOKENS, "--json", *CONFIG]) == 0
    return json.loads(buffer.getvalue().strip().splitlines()[-1])["tokens"]


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    """Export each format once per test session (the slow part); {format: directory}."""
    made = {}

    def get(fmt):
        if fmt not in made:
            out = tmp_path_factory.mktemp(fmt)
            import contextlib
            import io

            with contextlib.redirect_stdout(io.StringIO()):
                assert main(["export", "--format", fmt, "--out", str(out), "--max-seq-len", "64", "--overwrite",
                             *CONFIG]) == 0
            made[fmt] = out
        return made[fmt]

    return get


@pytest.fixture(scope="module")
def tiny_pt2(tmp_path_factory):
    """A pt2 export of a random 2-layer Llama GGUF (seconds, where the default model's takes a minute)."""
    import contextlib
    import io

    from gguf_files import write_tiny_llama_gguf

    gguf = tmp_path_factory.mktemp("tiny") / "tiny-llama.gguf"
    write_tiny_llama_gguf(gguf)
    out = tmp_path_factory.mktemp("tiny-pt2")
    with contextlib.redirect_stdout(io.StringIO()):
        assert main(["export", "--model", str(gguf), "--format", "pt2", "--out", str(out), "--max-seq-len", "64",
                     "--overwrite", *CONFIG]) == 0
    return out


# The default model to pt2 and ONNX (a minute or two each); AOTInductor and ExecuTorch exports of the
# 30 layers took 4 to 12 minutes each, and run on the 2-layer models of test_export_options.py and
# test_three_bit.py, every option included.
@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["pt2", "onnx"])
def test_exported_greedy_tokens_equal_eager(fmt, exports, eager_tokens, capsys):
    if fmt == "pte":
        pytest.importorskip("executorch.runtime")
    out = exports(fmt)
    report = cli_json(["run-exported", str(out), "--prompt", PROMPT, "--max-new-tokens", NEW_TOKENS, "--json"], capsys)
    assert report["tokens"] == eager_tokens
    assert report["config"]["format"] == fmt
    assert report["config"]["kivi"]["group_size"] == 8
    assert "Paris" in report["text"]


def test_pt2_keeps_the_kivi_ops_and_has_no_pickles(tiny_pt2):
    out = tiny_pt2
    check_pt2_has_no_pickles(out / "model.pt2")
    ep = torch.export.load(out / "model.pt2")
    targets = {str(node.target) for node in ep.graph.nodes}
    assert {"kivi.cache_append.default", "kivi.cache_attend.default"} <= targets


@pytest.mark.slow  # a new interpreter loading the 30-layer program: about a minute
def test_run_exported_in_a_fresh_process(exports):
    """The runner needs no model code path: a new interpreter loads the artifact only."""
    out = exports("pt2")
    proc = subprocess.run([sys.executable, "-m", "kivi_cli", "run-exported", str(out), "--prompt", PROMPT,
                           "--max-new-tokens", "4", "--json"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(report) >= {"text", "tokens", "prompt_tokens", "new_tokens", "decode_tokens_per_s", "cache_bytes", "config"}


def test_corrupt_or_mismatched_artifacts_are_refused(tiny_pt2, tmp_path):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(tiny_pt2, copy)
    meta = json.loads((copy / METADATA_FILE).read_text())

    (copy / METADATA_FILE).write_text(json.dumps({**meta, "schema_version": 99}))
    with pytest.raises(ArtifactError, match="schema_version"):
        read_metadata(copy)
    # An export made before the cache state was named by per-layer modules: re-export it.
    (copy / METADATA_FILE).write_text(json.dumps({**meta, "schema_version": 1}))
    with pytest.raises(ArtifactError, match="schema_version 1; this kivi reads 3. Re-export"):
        read_metadata(copy)

    (copy / METADATA_FILE).write_text(json.dumps({**meta, "format": "onnx"}))
    with pytest.raises(ArtifactError, match="format"):
        read_metadata(copy)

    (copy / METADATA_FILE).write_text(json.dumps(meta))
    with open(copy / "model.pt2", "r+b") as f:  # flip one byte of the program
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(ArtifactError, match="corrupt"):
        read_metadata(copy)

    with pytest.raises(ArtifactError, match="not a KIVI export"):
        read_metadata(tmp_path)


def test_pt2_from_another_torch_is_refused(tiny_pt2, tmp_path):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(tiny_pt2, copy)
    from kivi_export.artifact import metadata_digest

    meta = json.loads((copy / METADATA_FILE).read_text())
    meta["versions"] = {**meta["versions"], "torch": "2.0.0"}
    meta["digest"] = metadata_digest(meta)  # as that torch's exporter signed it (the digest is checked first)
    (copy / METADATA_FILE).write_text(json.dumps(meta))
    with pytest.raises(ArtifactError, match="torch 2.0.0"):
        read_metadata(copy)


def test_pickled_payloads_are_refused_before_loading(tmp_path):
    archive = tmp_path / "evil.pt2"
    config = {"config": {"w": {"path_name": "weight_0", "use_pickle": True}}}
    with zipfile.ZipFile(archive, "w") as z:
        z.writestr("evil/data/weights/model_weights_config.json", json.dumps(config))
    with pytest.raises(ArtifactError, match="pickled"):
        check_pt2_has_no_pickles(archive)


def test_export_refuses_to_overwrite_and_checks_arguments(tmp_path, capsys):
    (tmp_path / "keep.txt").write_text("user data")
    with pytest.raises(SystemExit):
        main(["export", "--format", "pt2", "--out", str(tmp_path)])
    assert "--overwrite" in capsys.readouterr().err
    assert (tmp_path / "keep.txt").read_text() == "user data"
    with pytest.raises(SystemExit):
        main(["export", "--format", "gguf", "--out", str(tmp_path / "x")])
    assert "invalid choice" in capsys.readouterr().err


def test_run_exported_checks_batch_and_capacity(tiny_pt2, capsys):
    out = tiny_pt2
    with pytest.raises(SystemExit):
        main(["run-exported", str(out), "--prompt", PROMPT, "--max-new-tokens", "100"])
    assert "max_seq_len=64" in capsys.readouterr().err


def test_decoder_cache_as_io_leaves_its_own_buffers_alone():
    """ONNX-style calling: the cache goes in and comes out; the module's buffers are untouched."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from kivi_models import make_cache, patch_model
    from kivi_ops import KIVIConfig

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2)).eval()
    patch_model(model)
    cache = make_cache(model, method="kivi", batch_size=1, max_seq_len=32,
                       kivi_config=KIVIConfig(group_size=4, residual_length=4))
    stateful = ExportableDecoder(model, cache)
    functional = ExportableDecoder(model, make_cache(model, method="kivi", batch_size=1, max_seq_len=32,
                                                     kivi_config=KIVIConfig(group_size=4, residual_length=4)),
                                   cache_as_io=True)
    ids = torch.randint(0, 64, (1, 9))
    state = functional.cache_tensors()
    with torch.no_grad():
        logits, *state = functional(ids, torch.zeros(1, dtype=torch.long), torch.tensor([9]), *state)
        assert torch.equal(logits, stateful(ids, torch.zeros(1, dtype=torch.long), torch.tensor([9])))
        for step in range(6):
            token = logits.argmax(-1)[:, None]
            pos = torch.tensor([9 + step])
            logits, *state = functional(token, pos, torch.ones(1, dtype=torch.long), *state)
            assert torch.equal(logits, stateful(token, pos, torch.ones(1, dtype=torch.long)))
    assert all(int(t.abs().sum()) == 0 for t in functional.cache_tensors())


def test_decoder_caps_the_final_logits_like_generate():
    """A family with final logit soft-capping (Gemma 2): the exported decoder returns the capped
    logits that `kivi generate` samples from (generate.lm_logits), not the raw LM head's."""
    from kivi_models import make_cache, patch_model
    from kivi_models.generate import lm_logits, prefill
    from kivi_ops import KIVIConfig
    from tiny_models import tiny_llama

    model = tiny_llama()
    model.config.final_logit_softcapping = 0.05  # far below the raw logits' range: the cap shows
    patch_model(model)
    config = KIVIConfig(group_size=4, residual_length=4)
    ids = torch.randint(0, 64, (1, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        exported = ExportableDecoder(model, make_cache(model, method="kivi", batch_size=1, max_seq_len=32,
                                                       kivi_config=config))(ids, torch.zeros(1, dtype=torch.long),
                                                                            torch.tensor([9]))
        reference = prefill(model, make_cache(model, method="kivi", batch_size=1, max_seq_len=32, kivi_config=config),
                            ids, torch.tensor([9]))
    assert exported.abs().max() <= 0.05
    assert torch.equal(exported, reference)
    model.config.final_logit_softcapping = None
    assert torch.equal(lm_logits(model, torch.ones(1, 32)), model.lm_head(torch.ones(1, 32)))


@pytest.mark.slow  # a minute: an int8 generate and a pt2 export of its own
def test_int8_weights_export_to_pt2_with_plain_tensors(tmp_path, capsys):
    """torchao int8 weights export unwrapped (plain int8 + scales, no pickled subclasses), and the
    program's greedy tokens equal `kivi generate --weight-quant int8`."""
    argv = ["--weight-quant", "int8", *CONFIG]
    eager = cli_json(["generate", "--prompt", PROMPT, "--max-new-tokens", "8", "--json", *argv], capsys)
    out = tmp_path / "int8"
    assert main(["export", "--format", "pt2", "--out", str(out), "--max-seq-len", "32", *argv]) == 0
    capsys.readouterr()
    check_pt2_has_no_pickles(out / "model.pt2")
    assert (out / "model.pt2").stat().st_size < 0.5 * 538e6  # int8 weights, not fp32
    report = cli_json(["run-exported", str(out), "--prompt", PROMPT, "--max-new-tokens", "8", "--json"], capsys)
    assert report["tokens"] == eager["tokens"]
    assert report["config"]["weight_quant"] == "int8"
