"""An exported KIVI decoder on disk: one directory, checked before anything in it is loaded.

    PATH/kivi_export.json   metadata: format, program file + sha256, model and cache config, versions,
                            the tokenizer files' sha256, and `digest` over all of it
    PATH/<program file>     model.pt2 | model_aoti.pt2 | model.onnx (+ model.onnx.data) | model.pte
    PATH/tokenizer/         the tokenizer (JSON files; no pickles)

`read_metadata` refuses a directory that is not an artifact, a metadata file from another schema
version, a field of the wrong type or out of range (the error names the field), metadata edited after
export (`digest` no longer matches), a missing tokenizer, a file whose bytes changed (sha256), and,
for the torch formats, an artifact written by another torch release.

The digest is sha256 over the canonical JSON of every metadata field but `digest` itself; the
fields include the sha256 of the program file(s) and of each tokenizer file, so one digest covers
the metadata together with every file the loader reads. It detects edits and corruption, not a
forger (anyone can recompute a sha256): the runtime therefore also takes the capacity from the
loaded program itself (runtime.py).
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import asdict, dataclass, field, fields
from importlib import metadata as importlib_metadata
from pathlib import Path
from typing import Optional

import torch

# 3: `digest` covers every field and the tokenizer files' sha256 (tokenizer_files);
# 2: the cache state is named by per-layer modules (layers.N.k_codes, ...)
SCHEMA_VERSION = 3
METADATA_FILE = "kivi_export.json"
TOKENIZER_DIR = "tokenizer"
FORMATS = ("pt2", "aoti", "onnx", "pte")
PROGRAM_DATA_SUFFIX = ".data"  # ONNX's external data: model.onnx -> model.onnx.data (formats.save_onnx)
PROGRAM_FILES = {"pt2": "model.pt2", "aoti": "model_aoti.pt2", "onnx": "model.onnx", "pte": "model.pte"}
# Formats whose files only the torch release that wrote them is known to read.
TORCH_BOUND_FORMATS = ("pt2", "aoti")
METHODS = ("kivi", "fp")
DTYPES = ("float32", "float16", "bfloat16")
WEIGHT_QUANT_MODES = ("none", "int8", "int4")
# The exporter traces the program with a 2-token prompt (a dynamic dim must not be traced at size
# 0 or 1), so a program holds at least 2 tokens.
MIN_MAX_SEQ_LEN = 2
# The names transformers' tokenizer.save_pretrained writes (its config, special-token and added-token
# files, chat templates, and the vocabulary files of the tokenizer classes): the only files under
# tokenizer/ that `--overwrite` takes as an export's, whatever tokenizer_files lists (written_files).
TOKENIZER_FILE_NAMES = frozenset((
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "chat_template.jinja", "chat_template.json", "vocab.json", "merges.txt", "vocab.txt", "tokenizer.model",
    "spiece.model", "sentencepiece.bpe.model", "sentencepiece.model", "spm.model"))
CHAT_TEMPLATE_DIR = "additional_chat_templates"  # <name>.jinja: a tokenizer's named chat templates
# Fields the exporter fills in when it writes the files (write_metadata).
FILE_FIELDS = ("program", "sha256", "extra_sha256", "tokenizer_files", "digest")


class ArtifactError(ValueError):
    """The path is not a usable KIVI export (missing, corrupt, edited, or from another version)."""


def package_versions() -> dict[str, str]:
    versions = {"torch": torch.__version__}
    for name in ("kivi-ops", "transformers", "torchao", "onnx", "onnxscript", "onnxruntime", "executorch"):
        try:
            versions[name] = importlib_metadata.version(name)
        except importlib_metadata.PackageNotFoundError:
            pass
    return versions


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            digest.update(chunk)
    return digest.hexdigest()


@dataclass
class ExportMetadata:
    format: str
    model: str  # what --model named ("default" or a directory)
    model_type: str
    vocab_size: int
    num_layers: int
    method: str  # "kivi" or "fp"
    kivi: Optional[dict]  # KIVIConfig.to_dict() for method "kivi"
    batch_size: int
    max_seq_len: int
    dtype: str
    weight_quant: str
    eos_token_id: Optional[int]
    pad_token_id: int
    cache_bytes: int
    fp16_cache_bytes: int
    cache_names: list[str]  # the cache tensors, in input/output order (formats with cache_as_io)
    program: str = ""
    sha256: str = ""
    extra_files: list[str] = field(default_factory=list)  # e.g. ONNX external data, hashed too
    extra_sha256: list[str] = field(default_factory=list)
    tokenizer_files: dict = field(default_factory=dict)  # path under tokenizer/ -> sha256
    versions: dict = field(default_factory=package_versions)
    schema_version: int = SCHEMA_VERSION
    digest: str = ""  # sha256 over every other field (metadata_digest)

    def config_summary(self) -> dict:
        return {"model": self.model, "method": self.method, "batch_size": self.batch_size,
                "max_seq_len": self.max_seq_len, "dtype": self.dtype, "weight_quant": self.weight_quant,
                **({"kivi": self.kivi} if self.kivi else {})}


FIELD_NAMES = tuple(f.name for f in fields(ExportMetadata))


def metadata_digest(raw: dict) -> str:
    """sha256 over the canonical JSON (sorted keys, no whitespace, ASCII) of every field but `digest`."""
    body = {name: value for name, value in raw.items() if name != "digest"}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)
    return hashlib.sha256(b"kivi-export\n" + text.encode()).hexdigest()


# ---------------------------------------------------------------- field checks

_HEX64 = re.compile(r"[0-9a-f]{64}")
_FILE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]*")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_sha(v) -> bool:
    return isinstance(v, str) and _HEX64.fullmatch(v) is not None


def _is_safe_name(v) -> bool:
    """A plain file name (no separators, no '..', not hidden)."""
    return isinstance(v, str) and _FILE_NAME.fullmatch(v) is not None


def _is_file_name(v) -> bool:
    """A plain file name in the export directory, other than the metadata and the tokenizer."""
    return _is_safe_name(v) and v not in (METADATA_FILE, TOKENIZER_DIR)


def _is_relative_path(v) -> bool:
    return isinstance(v, str) and all(_is_safe_name(part) for part in v.split("/"))


def _check_kivi(kivi) -> Optional[str]:
    """None if `kivi` is a KIVIConfig.to_dict(), else why not."""
    from kivi_ops.config import KIVIConfig

    if not isinstance(kivi, dict):
        return "an object (KIVIConfig fields) for method 'kivi'"
    want = {f.name for f in fields(KIVIConfig)}
    # Artifacts written before flush_policy or the rotations existed ran their defaults (KIVI's
    # policy, no rotation).
    later = {"flush_policy", "rotate_keys", "rotate_values", "rotation_seed", "rotations", "layer_bits"}
    if not want - later <= set(kivi) <= want:
        return f"an object with exactly the KIVIConfig fields {sorted(want)}"
    values = dict(kivi)
    for name in ("key_levels", "value_levels"):
        tables = values[name]
        if not isinstance(tables, list) or not all(isinstance(t, list) for t in tables):
            return f"a KIVIConfig ({name} must be a list of per-layer level lists)"
        values[name] = tuple(tuple(t) for t in tables)
    widths = values.get("layer_bits", [])
    if not isinstance(widths, list) or not all(isinstance(p, list) for p in widths):
        return "a KIVIConfig (layer_bits must be a list of [k_bits, v_bits] pairs)"
    values["layer_bits"] = tuple(tuple(p) for p in widths)
    # calibrated rotations are recorded as their file and digest (the program embeds the matrices)
    rotations = values.pop("rotations", None)
    if rotations is not None and not (isinstance(rotations, dict) and set(rotations) == {"file", "sha256"}
                                      and all(isinstance(v, str) for v in rotations.values())):
        return "a KIVIConfig (rotations must be null or {\"file\": str, \"sha256\": str})"
    if (rotations is not None) != ("calibrated" in (values.get("rotate_keys"), values.get("rotate_values"))):
        return "a KIVIConfig (rotations are recorded exactly when a rotation is 'calibrated')"
    for name in ("rotate_keys", "rotate_values"):
        if values.get(name) == "calibrated":
            values[name] = "none"
    try:
        KIVIConfig(**values)
    except (TypeError, ValueError) as e:
        return f"a valid KIVIConfig ({e})"
    return None


def check_fields(raw: dict, where: str, *, files: bool = True) -> None:
    """Check every metadata field's type and range before any is used; the ArtifactError names the
    field. files=False skips the fields write_metadata fills in (the exporter checks the rest before
    it writes anything)."""
    names = [n for n in FIELD_NAMES if files or n not in FILE_FIELDS]
    missing = [n for n in names if n not in raw]
    unknown = [n for n in raw if n not in FIELD_NAMES]
    if missing or unknown:
        raise ArtifactError(f"{where} does not hold KIVI export metadata (missing fields {missing}, "
                            f"unknown fields {unknown}). Re-export the model")

    def bad(name: str, want: str):
        raise ArtifactError(f"{where}: field {name!r} must be {want}, got {raw[name]!r}. Re-export the model")

    if raw["schema_version"] != SCHEMA_VERSION:
        bad("schema_version", str(SCHEMA_VERSION))
    if raw["format"] not in FORMATS:
        bad("format", f"one of {FORMATS}")
    for name in ("model", "model_type"):
        if not isinstance(raw[name], str) or not raw[name]:
            bad(name, "a non-empty string")
    for name in ("vocab_size", "num_layers", "batch_size"):
        if not _is_int(raw[name]) or raw[name] < 1:
            bad(name, "a positive integer")
    if not _is_int(raw["max_seq_len"]) or raw["max_seq_len"] < MIN_MAX_SEQ_LEN:
        bad("max_seq_len", f"an integer >= {MIN_MAX_SEQ_LEN}")
    if raw["method"] not in METHODS:
        bad("method", f"one of {METHODS}")
    if raw["method"] == "kivi":
        why = _check_kivi(raw["kivi"])
        if why:
            bad("kivi", why)
    elif raw["kivi"] is not None:
        bad("kivi", "null for method 'fp'")
    if raw["dtype"] not in DTYPES:
        bad("dtype", f"one of {DTYPES}")
    if raw["weight_quant"] not in WEIGHT_QUANT_MODES:
        bad("weight_quant", f"one of {WEIGHT_QUANT_MODES}")
    vocab = raw["vocab_size"]
    if raw["eos_token_id"] is not None and not (_is_int(raw["eos_token_id"]) and 0 <= raw["eos_token_id"] < vocab):
        bad("eos_token_id", f"null or a token id in [0, {vocab}) (vocab_size)")
    if not (_is_int(raw["pad_token_id"]) and 0 <= raw["pad_token_id"] < vocab):
        bad("pad_token_id", f"a token id in [0, {vocab}) (vocab_size)")
    for name in ("cache_bytes", "fp16_cache_bytes"):
        if not _is_int(raw[name]) or raw[name] < 0:
            bad(name, "a non-negative integer")
    names = raw["cache_names"]
    if not isinstance(names, list) or not names or not all(isinstance(n, str) and n for n in names) \
            or len(set(names)) != len(names):
        bad("cache_names", "a non-empty list of distinct names")
    if not isinstance(raw["versions"], dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in raw["versions"].items()):
        bad("versions", "an object of package name -> version strings")
    extra = raw["extra_files"]
    if not isinstance(extra, list) or not all(_is_file_name(n) for n in extra) or len(set(extra)) != len(extra) \
            or PROGRAM_FILES[raw["format"]] in extra:
        bad("extra_files", "a list of distinct plain file names in the export directory")
    if not files:
        return
    if raw["program"] != PROGRAM_FILES[raw["format"]]:
        bad("program", f"{PROGRAM_FILES[raw['format']]!r} for format {raw['format']!r}")
    if not _is_sha(raw["sha256"]):
        bad("sha256", "a sha256 (64 lowercase hex digits)")
    if not isinstance(raw["extra_sha256"], list) or len(raw["extra_sha256"]) != len(extra) \
            or not all(_is_sha(h) for h in raw["extra_sha256"]):
        bad("extra_sha256", "one sha256 per extra file")
    tok = raw["tokenizer_files"]
    if not isinstance(tok, dict) or not tok or not all(_is_relative_path(k) and _is_sha(v) for k, v in tok.items()):
        bad("tokenizer_files", f"a non-empty object of paths under {TOKENIZER_DIR}/ -> sha256")
    if not _is_sha(raw["digest"]):
        bad("digest", "a sha256 (64 lowercase hex digits)")


# ---------------------------------------------------------------- write / read


def tokenizer_hashes(tokenizer_dir: Path) -> dict[str, str]:
    """{path relative to tokenizer_dir (POSIX): sha256} of every file under it."""
    return {p.relative_to(tokenizer_dir).as_posix(): sha256_of(p)
            for p in sorted(tokenizer_dir.rglob("*")) if p.is_file()}


def write_metadata(out: Path, meta: ExportMetadata) -> None:
    """Hash the program file(s) and the tokenizer, check every field, sign them all with one digest
    and write the metadata last, so a half-written export is never mistaken for a finished one."""
    meta.program = PROGRAM_FILES[meta.format]
    meta.sha256 = sha256_of(out / meta.program)
    meta.extra_sha256 = [sha256_of(out / name) for name in meta.extra_files]
    meta.tokenizer_files = tokenizer_hashes(out / TOKENIZER_DIR)
    meta.schema_version = SCHEMA_VERSION
    raw = json.loads(json.dumps(asdict(meta), allow_nan=False))  # as read_metadata will see it
    raw["digest"] = meta.digest = metadata_digest(raw)
    check_fields(raw, str(out / METADATA_FILE))
    (out / METADATA_FILE).write_text(json.dumps(raw, indent=2, allow_nan=False) + "\n")


def _no_constants(name: str):
    raise ValueError(f"{name} is not a JSON number")


def _artifact_file(path: Path, name: str) -> Path:
    file = path / name
    if not file.is_file():
        raise ArtifactError(f"{file} is missing; the export is incomplete. Re-export the model")
    return file


def signed_fields(path: Path) -> dict:
    """The fields of `path`'s kivi_export.json once its JSON, schema version, every field and its
    digest check (ArtifactError naming the first problem otherwise). Reads nothing but that file."""
    meta_file = Path(path) / METADATA_FILE
    if not meta_file.is_file():
        raise ArtifactError(f"{path} is not a KIVI export: {METADATA_FILE} is missing (create one with `kivi export`)")
    try:
        raw = json.loads(meta_file.read_text(), parse_constant=_no_constants)
    except (OSError, ValueError) as e:  # ValueError: also JSONDecodeError, UnicodeDecodeError
        raise ArtifactError(f"{meta_file} is not valid JSON ({e}); re-export the model") from e
    if not isinstance(raw, dict) or raw.get("schema_version") != SCHEMA_VERSION:
        found = raw.get("schema_version") if isinstance(raw, dict) else None
        raise ArtifactError(f"{meta_file} has schema_version {found!r}; this kivi reads {SCHEMA_VERSION}. Re-export the model")
    check_fields(raw, str(meta_file))
    if metadata_digest(raw) != raw["digest"]:
        raise ArtifactError(f"{meta_file} was changed after export: its digest does not match its fields "
                            f"(the config, capacity and file hashes are signed together). Re-export the model")
    return raw


def written_files(raw: dict) -> set[str]:
    """The paths (relative, POSIX) an export wrote, as its signed metadata lists them, kept to the
    names an export writes: the metadata itself, the program file of its format and that file's
    external data (ONNX, PROGRAM_DATA_SUFFIX), and the tokenizer files a tokenizer writes
    (is_tokenizer_file). The digest is an unkeyed sha256 that anyone can recompute, so a listed name
    outside these is not taken as the export's: `--overwrite` then refuses, naming it, instead of
    deleting it."""
    program = PROGRAM_FILES[raw["format"]]
    data = f"{program}{PROGRAM_DATA_SUFFIX}"
    return {METADATA_FILE, program, *({data} & set(raw["extra_files"])),
            *(f"{TOKENIZER_DIR}/{name}" for name in raw["tokenizer_files"] if is_tokenizer_file(name))}


def is_tokenizer_file(name: str) -> bool:
    """Whether `name` (a path under tokenizer/) is one transformers' save_pretrained writes."""
    folder, _, file = name.rpartition("/")
    if folder == CHAT_TEMPLATE_DIR:
        return file.endswith(".jinja") and _is_safe_name(file)
    return not folder and file in TOKENIZER_FILE_NAMES


def read_metadata(path: Path, *, verify: bool = True) -> ExportMetadata:
    """The checked metadata of the export at `path`. verify=False skips re-hashing the files (the
    metadata's own checks, its digest and the files' presence still apply)."""
    path = Path(path)
    meta = ExportMetadata(**signed_fields(path))
    if meta.format in TORCH_BOUND_FORMATS and meta.versions.get("torch") != torch.__version__:
        raise ArtifactError(
            f"{path} was exported with torch {meta.versions.get('torch')}, this is torch {torch.__version__}: "
            f"{meta.format} programs are only read by the release that wrote them. Re-export with this torch"
        )
    tokenizer_dir = path / TOKENIZER_DIR
    if not tokenizer_dir.is_dir():
        raise ArtifactError(f"{tokenizer_dir} is missing; the export is incomplete. Re-export the model")
    files = [_artifact_file(path, name) for name in (meta.program, *meta.extra_files)]
    tokenizer_files = [_artifact_file(tokenizer_dir, name) for name in meta.tokenizer_files]
    if not verify:
        return meta
    for file, expected in zip(files, [meta.sha256, *meta.extra_sha256]):
        if sha256_of(file) != expected:
            raise ArtifactError(f"{file} is corrupt: its sha256 differs from the one recorded at export. Re-export the model")
    found = set(tokenizer_hashes(tokenizer_dir))
    if found != set(meta.tokenizer_files):
        raise ArtifactError(f"{tokenizer_dir} holds files the export did not write ({sorted(found - set(meta.tokenizer_files))}); "
                            f"re-export the model")
    for file, expected in zip(tokenizer_files, meta.tokenizer_files.values()):
        if sha256_of(file) != expected:
            raise ArtifactError(f"{file} is corrupt: its sha256 differs from the one recorded at export. Re-export the model")
    return meta
