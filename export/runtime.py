"""Loading an export and generating from it, without building the model in Python."""

from __future__ import annotations

from pathlib import Path

import torch

from .artifact import TOKENIZER_DIR, ArtifactError, ExportMetadata, read_metadata
from .formats import ProgramShape, Step, load_aoti, load_onnx, load_pt2, load_pte

LOADERS = {"pt2": load_pt2, "aoti": load_aoti, "onnx": load_onnx, "pte": load_pte}


def load_exported(path: Path) -> tuple[ExportMetadata, object, Step]:
    """(metadata, tokenizer, step) of the export at `path`; checks it first (artifact.py).

    The batch size and capacity come from the loaded program (formats.py says where, per format)
    and must equal the metadata's, so meta.batch_size / meta.max_seq_len are the program's own;
    the returned step refuses any call that would grow a row past that capacity."""
    from transformers import AutoTokenizer

    path = Path(path)
    meta = read_metadata(path)
    if meta.format not in LOADERS:
        raise ArtifactError(f"{path}: no loader for format {meta.format!r} in this build")
    try:
        tokenizer = AutoTokenizer.from_pretrained(path / TOKENIZER_DIR, local_files_only=True)
    except Exception as e:  # transformers raises many types (OSError, ValueError, JSON errors) for a bad tokenizer
        raise ArtifactError(f"{path / TOKENIZER_DIR} is not a loadable tokenizer ({type(e).__name__}: {e}). "
                            f"Re-export the model") from None
    step, shape = LOADERS[meta.format](path / meta.program, meta)
    if shape is None:  # aoti from a torch whose packages do not record constant shapes: the signed metadata
        shape = ProgramShape(meta.batch_size, meta.max_seq_len, f"{path}: metadata (digest-checked)")
    elif (shape.batch_size, shape.max_seq_len) != (meta.batch_size, meta.max_seq_len):
        raise ArtifactError(
            f"{path}: the program was built for batch_size={shape.batch_size}, max_seq_len={shape.max_seq_len} "
            f"(from {shape.source}), but its metadata says batch_size={meta.batch_size}, "
            f"max_seq_len={meta.max_seq_len}. Re-export the model")
    return meta, tokenizer, capacity_guard(step, shape)


def capacity_guard(step: Step, shape: ProgramShape) -> Step:
    """`step`, refusing (ValueError, before the program runs) a call of the wrong batch size or one
    that would grow a row past the program's capacity: past it the compiled cache math does not
    check and would silently write out of place. Tracks each row's length as the program does
    (a row at position 0 restarts)."""
    batch, capacity = shape.batch_size, shape.max_seq_len
    lengths = torch.zeros(batch, dtype=torch.long)

    def guarded(input_ids: torch.Tensor, input_pos: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        if input_ids.dim() != 2 or input_ids.shape[0] != batch or not 1 <= input_ids.shape[1] <= capacity:
            raise ValueError(f"input_ids must be [{batch}, 1..{capacity}] (the program's batch size and "
                             f"capacity), got {list(input_ids.shape)}")
        if tuple(input_pos.shape) != (batch,) or tuple(counts.shape) != (batch,):
            raise ValueError(f"input_pos and counts must be [{batch}], got {list(input_pos.shape)} and {list(counts.shape)}")
        n = input_ids.shape[1]
        pos, cnt = input_pos.detach().cpu().long(), counts.detach().cpu().long()
        if bool(((cnt < 1) | (cnt > n)).any()) or bool((pos < 0).any()):
            raise ValueError(f"counts must be in [1, {n}] and input_pos >= 0, got counts={cnt.tolist()}, "
                             f"input_pos={pos.tolist()}")
        grown = torch.where(pos == 0, torch.zeros_like(lengths), lengths) + cnt
        end = torch.maximum(grown, pos + cnt)
        if bool((end > capacity).any()):
            b = int((end > capacity).nonzero()[0])
            raise ValueError(f"row {b} would hold {int(end[b])} tokens, past the program's capacity "
                             f"max_seq_len={capacity} ({shape.source}); re-export with a larger --max-seq-len")
        logits = step(input_ids, input_pos, counts)
        lengths.copy_(grown)
        return logits

    return guarded
