"""An exported KIVI decoder on disk: one directory, checked before anything in it is loaded.

    PATH/kivi_export.json   metadata: format, program file + sha256, model and cache config, versions
    PATH/<program file>     model.pt2 | model_aoti.pt2 | model.onnx (+ model.onnx.data) | model.pte
    PATH/tokenizer/         the tokenizer (JSON files; no pickles)

`read_metadata` refuses a directory that is not an artifact, a metadata file from another
schema version or format, a program file whose bytes changed (sha256), and, for the torch
formats, an artifact written by another torch release.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from importlib import metadata as importlib_metadata
from pathlib import Path
from typing import Optional

import torch

SCHEMA_VERSION = 2  # 2: the cache state is named by per-layer modules (layers.N.k_codes, ...)
METADATA_FILE = "kivi_export.json"
TOKENIZER_DIR = "tokenizer"
FORMATS = ("pt2", "aoti", "onnx", "pte")
PROGRAM_FILES = {"pt2": "model.pt2", "aoti": "model_aoti.pt2", "onnx": "model.onnx", "pte": "model.pte"}
# Formats whose files only the torch release that wrote them is known to read.
TORCH_BOUND_FORMATS = ("pt2", "aoti")


class ArtifactError(ValueError):
    """The path is not a usable KIVI export (missing, corrupt, or from another version)."""


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
    versions: dict = field(default_factory=package_versions)
    schema_version: int = SCHEMA_VERSION

    def config_summary(self) -> dict:
        return {"model": self.model, "method": self.method, "batch_size": self.batch_size,
                "max_seq_len": self.max_seq_len, "dtype": self.dtype, "weight_quant": self.weight_quant,
                **({"kivi": self.kivi} if self.kivi else {})}


def write_metadata(out: Path, meta: ExportMetadata) -> None:
    """Hash the program file(s) and write the metadata last, so a half-written export is never
    mistaken for a finished one."""
    meta.program = PROGRAM_FILES[meta.format]
    meta.sha256 = sha256_of(out / meta.program)
    meta.extra_sha256 = [sha256_of(out / name) for name in meta.extra_files]
    (out / METADATA_FILE).write_text(json.dumps(asdict(meta), indent=2) + "\n")


def read_metadata(path: Path, *, verify: bool = True) -> ExportMetadata:
    path = Path(path)
    meta_file = path / METADATA_FILE
    if not meta_file.is_file():
        raise ArtifactError(f"{path} is not a KIVI export: {METADATA_FILE} is missing (create one with `kivi export`)")
    try:
        raw = json.loads(meta_file.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ArtifactError(f"{meta_file} is not valid JSON ({e}); re-export the model") from e
    if not isinstance(raw, dict) or raw.get("schema_version") != SCHEMA_VERSION:
        found = raw.get("schema_version") if isinstance(raw, dict) else None
        raise ArtifactError(f"{meta_file} has schema_version {found!r}; this kivi reads {SCHEMA_VERSION}. Re-export the model")
    try:
        meta = ExportMetadata(**raw)
    except TypeError as e:
        raise ArtifactError(f"{meta_file} does not hold KIVI export metadata ({e})") from e
    if meta.format not in FORMATS or meta.program != PROGRAM_FILES[meta.format]:
        raise ArtifactError(f"{meta_file}: format must be one of {FORMATS} with program {PROGRAM_FILES.get(meta.format)}, "
                            f"got format={meta.format!r}, program={meta.program!r}")
    if meta.format in TORCH_BOUND_FORMATS and meta.versions.get("torch") != torch.__version__:
        raise ArtifactError(
            f"{path} was exported with torch {meta.versions.get('torch')}, this is torch {torch.__version__}: "
            f"{meta.format} programs are only read by the release that wrote them. Re-export with this torch"
        )
    if verify:
        for name, expected in [(meta.program, meta.sha256), *zip(meta.extra_files, meta.extra_sha256)]:
            file = path / name
            if not file.is_file():
                raise ArtifactError(f"{file} is missing; the export is incomplete. Re-export the model")
            if sha256_of(file) != expected:
                raise ArtifactError(f"{file} is corrupt: its sha256 differs from the one recorded at export. Re-export the model")
    return meta
