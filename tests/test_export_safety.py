"""`kivi export` never loses data or mixes two exports, and `run-exported` trusts nothing it has not
checked: staged + atomic writes, the target lock, the metadata digest, field checks, the program's
own capacity. A tiny Llama (exports in seconds) unless the test needs the CLI."""

import json
import shutil
import threading

import pytest
import torch

from kivi_export import exporter
from kivi_export.artifact import METADATA_FILE, TOKENIZER_DIR, ArtifactError, read_metadata, sha256_of
from kivi_export.exporter import export_decoder
from kivi_export.runtime import load_exported
from kivi_ops import KIVIConfig
from tiny_models import tiny_llama

MAX_SEQ_LEN = 16
KIVI = KIVIConfig(group_size=4, residual_length=4)


@pytest.fixture(scope="module")
def tiny():
    """(patched tiny LlamaForCausalLM, the default model's tokenizer)."""
    from transformers import AutoTokenizer

    from kivi_models import patch_model
    from kivi_models.loading import default_model_dir

    model = patch_model(tiny_llama())
    tokenizer = AutoTokenizer.from_pretrained(default_model_dir(), local_files_only=True)
    return model, tokenizer


def export(tiny, out, fmt="pt2", **kwargs):
    model, tokenizer = tiny
    options = dict(fmt=fmt, model_name="tiny", kivi_config=KIVI, batch_size=1, max_seq_len=MAX_SEQ_LEN)
    return export_decoder(model, tokenizer, out, **{**options, **kwargs})


@pytest.fixture(scope="module")
def pt2_export(tiny, tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny") / "pt2"
    export(tiny, out)
    return out


@pytest.fixture
def copy(pt2_export, tmp_path):
    target = tmp_path / "export"
    shutil.copytree(pt2_export, target)
    return target


def file_hashes(path):
    return {p.relative_to(path).as_posix(): sha256_of(p) for p in sorted(path.rglob("*")) if p.is_file()}


def leftovers(out):
    """Anything an export left beside its target: staging directories, the lock file."""
    return sorted(p.name for p in out.parent.iterdir() if p.name != out.name)


def rewrite(path, sign=False, **edits):
    raw = json.loads((path / METADATA_FILE).read_text())
    raw.update(edits)
    if sign:  # what someone who knows the scheme would do: recompute the digest
        from kivi_export.artifact import metadata_digest

        raw["digest"] = metadata_digest(raw)
    (path / METADATA_FILE).write_text(json.dumps(raw))


# ---------------------------------------------------------------- atomic overwrite, the target


@pytest.mark.parametrize("failure", [KeyboardInterrupt, RuntimeError])
def test_interrupted_overwrite_keeps_the_previous_export(failure, tiny, copy, monkeypatch):
    before = file_hashes(copy)

    def save_then_fail(ep, file):
        file.write_bytes(b"half a program")
        raise failure("interrupted")

    monkeypatch.setattr(exporter, "save_pt2", save_then_fail)
    with pytest.raises(failure):
        export(tiny, copy, max_seq_len=32, overwrite=True)
    assert file_hashes(copy) == before
    assert read_metadata(copy).max_seq_len == MAX_SEQ_LEN
    assert leftovers(copy) == []

    monkeypatch.undo()  # a good overwrite replaces it whole
    export(tiny, copy, max_seq_len=32, overwrite=True)
    assert read_metadata(copy).max_seq_len == 32
    assert leftovers(copy) == []


def test_ctrl_c_during_a_cli_overwrite_is_one_line(copy, monkeypatch, capsys):
    from transformers import AutoTokenizer

    from kivi_cli.main import main
    from kivi_models import loading
    from kivi_models.loading import default_model_dir
    from tiny_models import tiny_llama

    before = file_hashes(copy)
    tokenizer = AutoTokenizer.from_pretrained(default_model_dir(), local_files_only=True)
    monkeypatch.setattr(loading, "load_model", lambda *args, **kwargs: (tiny_llama(), tokenizer))

    def interrupted(ep, file):
        raise KeyboardInterrupt

    monkeypatch.setattr(exporter, "save_pt2", interrupted)
    code = main(["export", "--format", "pt2", "--out", str(copy), "--overwrite", "--group-size", "4",
                 "--residual-length", "4", "--max-seq-len", "32"])
    err = capsys.readouterr().err
    assert code == 130 and "Traceback" not in err and f"kivi export: interrupted; --out {copy} was left as it was" in err
    assert file_hashes(copy) == before and leftovers(copy) == []


def test_ctrl_c_while_the_export_is_put_in_place_waits_for_it(tiny, copy, monkeypatch):
    # SIGINT between the exchange of the two directories and the removal of the old export: both
    # finish, and the new export is whole (a KeyboardInterrupt raised there removed the staging
    # path, which held the old export then, and reported a failed export that had been put in place).
    import os
    import signal

    exchange = exporter._exchange

    def exchange_then_ctrl_c(a, b):
        done = exchange(a, b)
        os.kill(os.getpid(), signal.SIGINT)
        return done

    monkeypatch.setattr(exporter, "_exchange", exchange_then_ctrl_c)
    export(tiny, copy, max_seq_len=32, overwrite=True)
    assert read_metadata(copy).max_seq_len == 32 and leftovers(copy) == []


def test_overwrite_replaces_only_a_kivi_export(tiny, tmp_path):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("user data")
    for overwrite in (False, True):
        with pytest.raises(FileExistsError, match=r"--out .*not a KIVI export"):
            export(tiny, mine, overwrite=overwrite)
        assert (mine / "notes.txt").read_text() == "user data"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine"]


def tree(path):
    """Every entry under path with its bytes (None for a directory): what must survive a refusal."""
    return {p.relative_to(path).as_posix(): None if p.is_dir() else p.read_bytes() for p in sorted(path.rglob("*"))}


def project_with_copied_metadata(pt2_export, out):
    """A user's project holding a copy of a real export's (valid, signed) metadata."""
    (out / "src").mkdir(parents=True)
    (out / "src" / "main.py").write_text("print('mine')\n")
    (out / ".git").mkdir()
    (out / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    (out / "data.csv").write_text("a,b\n1,2\n")
    shutil.copy(pt2_export / METADATA_FILE, out / METADATA_FILE)
    return ["data.csv", ".git/", "src/"]


def export_with_user_files(pt2_export, out):
    """A real export the user added notes, results and a tokenizer file to."""
    shutil.copytree(pt2_export, out)
    (out / "NOTES.md").write_text("my notes\n")
    (out / "results").mkdir()
    (out / "results" / "run1.json").write_text("{}")
    (out / TOKENIZER_DIR / "my_vocab.txt").write_text("mine")
    return ["NOTES.md", "results/", f"{TOKENIZER_DIR}/my_vocab.txt"]


def export_with_a_link(pt2_export, out):
    """A real export holding a symbolic link to the user's data (never followed, never deleted)."""
    shutil.copytree(pt2_export, out)
    data = out.parent / "data"
    data.mkdir()
    (data / "big.bin").write_bytes(b"user data")
    (out / "data").symlink_to(data, target_is_directory=True)
    return ["data/"]


def crafted_metadata_listing_a_user_file(pt2_export, out):
    """A real export whose metadata was rewritten to list the user's files as its own, hashes and
    digest recomputed (the digest is unkeyed: anyone can). --overwrite deletes only the names kivi
    writes, whatever the metadata lists, so these are foreign still."""
    shutil.copytree(pt2_export, out)
    (out / "thesis.tex").write_text("three years of work\n")
    (out / "model.onnx.data").write_text("another tool's weights\n")
    names = ["thesis.tex", "model.onnx.data"]
    rewrite(out, sign=True, extra_files=names, extra_sha256=[sha256_of(out / n) for n in names])
    return names


def crafted_metadata_listing_a_user_tokenizer_file(pt2_export, out):
    """As above, with a user's file under tokenizer/ listed in tokenizer_files: only the names a
    tokenizer writes (tokenizer.json, ...) are an export's."""
    shutil.copytree(pt2_export, out)
    notes = out / TOKENIZER_DIR / "mynotes.txt"
    notes.write_text("my notes\n")
    listed = json.loads((out / METADATA_FILE).read_text())["tokenizer_files"]
    rewrite(out, sign=True, tokenizer_files={**listed, "mynotes.txt": sha256_of(notes)})
    return [f"{TOKENIZER_DIR}/mynotes.txt"]


def metadata_that_does_not_verify(raw):
    def layout(pt2_export, out):
        out.mkdir()
        (out / METADATA_FILE).write_text(raw if isinstance(raw, str) else json.dumps(raw))
        (out / "model.pt2").write_bytes(b"someone's program")
        return None  # refused whole, as not an intact export
    return layout


@pytest.mark.parametrize("layout", [
    project_with_copied_metadata,
    export_with_user_files,
    export_with_a_link,
    crafted_metadata_listing_a_user_file,
    crafted_metadata_listing_a_user_tokenizer_file,
    metadata_that_does_not_verify({"schema_version": 0, "format": "none"}),
    metadata_that_does_not_verify({"schema_version": 2, "format": "pt2"}),  # an older schema
    metadata_that_does_not_verify("not json"),
], ids=["copied-metadata-project", "user-files-in-export", "symlink-in-export", "crafted-metadata",
        "crafted-tokenizer-files", "schema-0-format-none",
        "old-schema", "bad-json"])
def test_overwrite_never_deletes_what_an_export_did_not_write(layout, tiny, pt2_export, tmp_path):
    out = tmp_path / "out"
    foreign = layout(pt2_export, out)
    before, beside = tree(out), sorted(p.name for p in tmp_path.iterdir())
    with pytest.raises(FileExistsError) as info:
        export(tiny, out, overwrite=True)
    if foreign is None:
        assert "not an intact KIVI export" in str(info.value) and "left untouched" in str(info.value)
    else:  # the refusal names every foreign entry
        assert "holds files the export did not write: " + ", ".join(sorted(foreign)) in str(info.value)
    assert tree(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == beside  # no staging directory or lock left


def test_cli_overwrite_refusal_names_the_file(pt2_export, tmp_path, capsys):
    from kivi_cli.main import main

    out = tmp_path / "out"
    export_with_user_files(pt2_export, out)
    with pytest.raises(SystemExit) as info:
        main(["export", "--format", "pt2", "--out", str(out), "--overwrite"])
    assert info.value.code != 0
    assert "NOTES.md" in capsys.readouterr().err
    assert (out / "NOTES.md").read_text() == "my notes\n"


def test_a_file_added_during_the_export_is_kept(tiny, copy, monkeypatch):
    """The check runs before the slow part; a file written into the target after it is moved aside
    with the replaced export, not deleted."""
    real_save = exporter.save_pt2

    def save_while_the_user_writes(ep, file):
        (copy / "late.txt").write_text("written during the export")
        real_save(ep, file)

    monkeypatch.setattr(exporter, "save_pt2", save_while_the_user_writes)
    export(tiny, copy, max_seq_len=32, overwrite=True)
    assert read_metadata(copy).max_seq_len == 32 and not (copy / "late.txt").exists()
    kept = [p for p in copy.parent.iterdir() if p.name.startswith(f"{copy.name}.kept-")]
    assert len(kept) == 1 and tree(kept[0]) == {"late.txt": b"written during the export"}


def test_out_naming_a_file_is_refused(tiny, tmp_path):
    file = tmp_path / "model.bin"
    file.write_bytes(b"user data")
    with pytest.raises(FileExistsError, match=r"--out .*is a file"):
        export(tiny, file, overwrite=True)
    assert file.read_bytes() == b"user data"


def test_max_seq_len_below_the_trace_length_is_refused_before_writing(tiny, tmp_path):
    out = tmp_path / "out"
    with pytest.raises(ValueError, match="at least 2"):
        export(tiny, out, max_seq_len=1)
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_cli_max_seq_len_1_is_a_clear_error(tmp_path, capsys):
    from kivi_cli.main import main

    out = tmp_path / "out"
    with pytest.raises(SystemExit):
        main(["export", "--format", "pt2", "--out", str(out), "--max-seq-len", "1"])
    assert "at least 2" in capsys.readouterr().err
    assert not out.exists()


def test_concurrent_exports_into_one_target_never_mix(tiny, tmp_path, monkeypatch):
    """The first export holds the target's lock while it writes; the second fails at once, clearly;
    the first's result is whole."""
    out = tmp_path / "out"
    inside, release = threading.Event(), threading.Event()
    real_save = exporter.save_pt2
    errors = []

    def slow_save(ep, file):
        if threading.current_thread().name == "first":
            inside.set()
            assert release.wait(60)
        real_save(ep, file)

    def first():
        try:
            export(tiny, out, max_seq_len=24)
        except BaseException as e:  # reported below
            errors.append(e)

    monkeypatch.setattr(exporter, "save_pt2", slow_save)
    thread = threading.Thread(target=first, name="first")
    thread.start()
    try:
        assert inside.wait(60)
        with pytest.raises(FileExistsError, match=r"--out .*another `kivi export`"):
            export(tiny, out, max_seq_len=MAX_SEQ_LEN, overwrite=True)
    finally:
        release.set()
        thread.join(60)
    assert not errors and not thread.is_alive()
    meta = read_metadata(out)  # every hash checks: one export's files, whole
    assert meta.max_seq_len == 24
    assert leftovers(out) == []


# ---------------------------------------------------------------- the metadata is signed and checked


@pytest.mark.parametrize("edit", [{"max_seq_len": 64}, {"batch_size": 2}, {"eos_token_id": 5},
                                  {"model": "someone-else"}, {"kivi": {**KIVI.to_dict(), "k_bits": 4}}])
def test_edited_metadata_is_refused(edit, copy):
    rewrite(copy, **edit)
    with pytest.raises(ArtifactError, match="changed after export"):
        read_metadata(copy)


@pytest.mark.parametrize("field, value", [("max_seq_len", "64"), ("max_seq_len", 1), ("batch_size", 0),
                                          ("batch_size", True), ("eos_token_id", 10**9), ("pad_token_id", -1),
                                          ("dtype", "float64"), ("method", "gptq"), ("cache_names", "layers"),
                                          ("extra_files", ["../../etc/passwd"]), ("kivi", {"group_size": 3}),
                                          ("tokenizer_files", {"../x": "0" * 64})])
def test_bad_fields_are_refused_by_name(field, value, copy):
    rewrite(copy, sign=True, **{field: value})
    with pytest.raises(ArtifactError, match=f"'{field}'"):
        read_metadata(copy)


def test_old_schema_asks_for_a_reexport(copy):
    raw = json.loads((copy / METADATA_FILE).read_text())
    for name in ("digest", "tokenizer_files"):
        raw.pop(name, None)
    (copy / METADATA_FILE).write_text(json.dumps({**raw, "schema_version": 2}))
    with pytest.raises(ArtifactError, match="schema_version 2; this kivi reads 3. Re-export"):
        read_metadata(copy)


def test_missing_or_changed_tokenizer_is_one_clear_error(copy):
    (copy / TOKENIZER_DIR / "tokenizer_config.json").write_text("{}")
    with pytest.raises(ArtifactError, match="tokenizer_config.json is corrupt"):
        read_metadata(copy)
    shutil.rmtree(copy / TOKENIZER_DIR)
    for check in (read_metadata, load_exported):
        with pytest.raises(ArtifactError, match=r"tokenizer is missing; the export is incomplete") as info:
            check(copy)
        assert info.value.__cause__ is None


# ---------------------------------------------------------------- the program's own capacity


def test_signed_but_false_capacity_is_refused_against_the_program(copy):
    rewrite(copy, sign=True, max_seq_len=64)
    read_metadata(copy)  # the digest matches: only the program can tell
    with pytest.raises(ArtifactError, match="program was built for batch_size=1, max_seq_len=16"):
        load_exported(copy)


def steps_until_refused(step, prompt_len=3, limit=40):
    """Greedy steps from a prompt; the position at which the runner refused (None: never)."""
    ids = torch.arange(1, prompt_len + 1)[None]
    logits = step(ids, torch.zeros(1, dtype=torch.long), torch.tensor([prompt_len]))
    pos = prompt_len
    for _ in range(limit):
        try:
            logits = step(logits.argmax(-1)[:, None], torch.tensor([pos]), torch.ones(1, dtype=torch.long))
        except ValueError as e:
            assert "capacity max_seq_len=16" in str(e)
            return pos
        pos += 1
    return None


def test_runner_stops_at_the_program_capacity(pt2_export):
    _, _, step = load_exported(pt2_export)
    assert steps_until_refused(step) == MAX_SEQ_LEN


@pytest.mark.slow
def test_onnx_capacity_comes_from_the_program(tiny, tmp_path):
    """ONNX's cache math does not check capacity: past it, tokens would be silently wrong. The runner
    reads the capacity from the cache inputs' static shapes and refuses to go past it."""
    out = tmp_path / "onnx"
    export(tiny, out, fmt="onnx")
    _, _, step = load_exported(out)
    assert steps_until_refused(step) == MAX_SEQ_LEN
    rewrite(out, sign=True, max_seq_len=64)
    with pytest.raises(ArtifactError, match="max_seq_len=16 \\(from .*cache inputs"):
        load_exported(out)


def test_an_intact_export_from_another_torch_can_be_overwritten(tiny, copy):
    """--overwrite checks that the old export is intact (signed), not that this torch can load it:
    re-exporting after a torch upgrade is what --overwrite is for."""
    rewrite(copy, sign=True, versions={"torch": "2.0.0"})
    with pytest.raises(ArtifactError, match="torch 2.0.0"):
        read_metadata(copy)
    export(tiny, copy, overwrite=True)
    assert read_metadata(copy).versions["torch"] == torch.__version__
