"""Loading an export and generating from it, without building the model in Python."""

from __future__ import annotations

from pathlib import Path

from .artifact import TOKENIZER_DIR, ArtifactError, ExportMetadata, read_metadata
from .formats import Step, load_aoti, load_onnx, load_pt2, load_pte

LOADERS = {"pt2": load_pt2, "aoti": load_aoti, "onnx": load_onnx, "pte": load_pte}


def load_exported(path: Path) -> tuple[ExportMetadata, object, Step]:
    """(metadata, tokenizer, step) of the export at `path`; checks it first (artifact.py)."""
    from transformers import AutoTokenizer

    path = Path(path)
    meta = read_metadata(path)
    if meta.format not in LOADERS:
        raise ArtifactError(f"{path}: no loader for format {meta.format!r} in this build")
    tokenizer = AutoTokenizer.from_pretrained(path / TOKENIZER_DIR, local_files_only=True)
    step = LOADERS[meta.format](path / meta.program, meta)
    return meta, tokenizer, step
