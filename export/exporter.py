"""`export_decoder`: a patched model + static cache -> an artifact directory (see artifact.py)."""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Optional

import torch

from kivi_models.generate import make_cache
from kivi_models.loading import log
from kivi_ops import KIVIConfig

from .artifact import FORMATS, PROGRAM_FILES, TOKENIZER_DIR, ExportMetadata, write_metadata
from .decoder import ExportableDecoder
from .formats import save_aoti, save_onnx, save_pt2, save_pte


def example_inputs(batch_size: int, device) -> tuple[torch.Tensor, ...]:
    """A two-token prompt (a dynamic dim must not be traced at size 0 or 1)."""
    n = 2
    return (torch.zeros(batch_size, n, dtype=torch.long, device=device),
            torch.zeros(batch_size, dtype=torch.long, device=device),
            torch.full((batch_size,), n, dtype=torch.long, device=device))


def trace(decoder: ExportableDecoder) -> torch.export.ExportedProgram:
    args = example_inputs(decoder.cache.batch_size, decoder.cache.device)
    tokens = torch.export.Dim("tokens", min=1, max=decoder.cache.max_seq_len)
    shapes = ({1: tokens}, None, None)
    if decoder.cache_as_io:  # forward(..., *cache): the varargs are one tuple in dynamic_shapes
        args, shapes = (*args, *decoder.cache_tensors()), (*shapes, (None,) * len(decoder.cache_names))
    with torch.no_grad():
        return torch.export.export(decoder, args, dynamic_shapes=shapes)


def export_decoder(
    model,
    tokenizer,
    out: Path,
    *,
    fmt: str,
    model_name: str,
    method: str = "kivi",
    kivi_config: Optional[KIVIConfig] = None,
    batch_size: int = 1,
    max_seq_len: int = 1024,
    weight_quant: str = "none",
    overwrite: bool = False,
) -> ExportMetadata:
    """Export `model` (already patched with patch_model, weights already quantized if asked)."""
    if fmt not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}, got {fmt!r}")
    context = model.config.max_position_embeddings
    if not 1 <= max_seq_len <= context:
        raise ValueError(f"max_seq_len must be in [1, {context}] (the model's context), got {max_seq_len}")
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        if not overwrite:
            raise FileExistsError(f"{out} exists and is not empty; pass --overwrite to replace it")
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)
    kivi_config = kivi_config or KIVIConfig()
    cache = make_cache(model, method=method, batch_size=batch_size, max_seq_len=max_seq_len, kivi_config=kivi_config)
    # ONNX and ExecuTorch cannot carry the kivi custom ops: the cache then runs core ATen forms
    # (kivi_ops/dispatch.py, "portable").
    cache.backing.portable = fmt in ("onnx", "pte")
    if weight_quant != "none":
        # torchao's quantized weights are tensor subclasses, which the exporters would pickle or
        # refuse; unwrapped, the program holds plain int8 tensors + scales and dequantizes in-graph.
        from torchao.utils import unwrap_tensor_subclass

        unwrap_tensor_subclass(model)
    decoder = ExportableDecoder(model, cache, cache_as_io=fmt == "onnx").eval()

    start = time.perf_counter()
    log(f"Tracing the decoder with torch.export ({fmt})...")
    ep = trace(decoder)
    log(f"Traced in {time.perf_counter() - start:.1f} s; writing {out / PROGRAM_FILES[fmt]}...")
    file = out / PROGRAM_FILES[fmt]
    extra_files: list[str] = []
    if fmt == "pt2":
        save_pt2(ep, file)
    elif fmt == "aoti":
        save_aoti(ep, file)
    elif fmt == "onnx":
        extra_files = save_onnx(ep, file)
    else:
        save_pte(ep, file)
    tokenizer.save_pretrained(out / TOKENIZER_DIR)
    eos = tokenizer.eos_token_id
    meta = ExportMetadata(
        format=fmt, model=model_name, model_type=model.config.model_type, vocab_size=model.config.vocab_size,
        num_layers=model.config.num_hidden_layers, method=method,
        kivi=kivi_config.to_dict() if method == "kivi" else None, batch_size=batch_size, max_seq_len=max_seq_len,
        dtype=str(model.dtype).replace("torch.", ""), weight_quant=weight_quant, eos_token_id=eos,
        pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos or 0),
        cache_bytes=cache.backing.nbytes(), fp16_cache_bytes=cache.backing.fp16_nbytes(),
        cache_names=decoder.cache_names,
        extra_files=extra_files,
    )
    write_metadata(out, meta)
    log(f"Exported in {time.perf_counter() - start:.1f} s to {out}")
    return meta
