"""Writing and loading each export format. A loaded program is a `Step`:

    step(input_ids [B, n] int64, input_pos [B] int64, counts [B] int64) -> logits [B, vocab] (torch)

holding the cache state between calls (export/decoder.py documents the calling convention).

Each loader returns (step, ProgramShape | None): the batch size and cache capacity read from the
program itself, never from kivi_export.json (runtime.py checks the metadata against it and keeps
every call within it):

    pt2   the cache buffers' static shapes in the ExportedProgram's graph
    aoti  the cache constants' shapes recorded in the package's generated wrapper source (None if
          this torch writes packages without it: the runtime then relies on the digest-covered metadata)
    onnx  the static shapes of the cache inputs
    pte   input_ids' upper-bound sizes [B, max_seq_len] in the program's method metadata
"""

from __future__ import annotations

import json
import re
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping, Optional, Sequence

import torch

from kivi_ops import cache_capacity

from .artifact import PROGRAM_DATA_SUFFIX, ArtifactError, ExportMetadata

Step = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class ProgramShape:
    """What a loaded program was built for: rows per call and cache capacity (tokens per row)."""

    batch_size: int
    max_seq_len: int
    source: str  # where in the program these were read, for messages


def shape_from_cache(shapes: Mapping[str, Sequence], source: str) -> Optional[ProgramShape]:
    """ProgramShape from the cache tensors' static shapes by state name (kivi_ops.cache_capacity).
    None when they are not a cache's."""
    try:
        found = cache_capacity(shapes)
    except ValueError as e:
        raise ArtifactError(f"{source}: {e}") from None
    if found is None:
        return None
    batch_size, max_seq_len, name = found
    return ProgramShape(batch_size=batch_size, max_seq_len=max_seq_len, source=f"{source} ({name})")


# ---------------------------------------------------------------- pt2 (torch.export)


def save_pt2(ep: torch.export.ExportedProgram, file: Path) -> None:
    # No example inputs in the archive: torch.export.load may unpickle them (see check below).
    ep._example_inputs = None
    torch.export.save(ep, file)


def check_pt2_has_no_pickles(file: Path) -> None:
    """torch.export.load unpickles (weights_only=False) payloads marked use_pickle and example
    inputs; our exporter writes neither, so an archive holding any is refused before loading."""
    try:
        with zipfile.ZipFile(file) as archive:
            for info in archive.infolist():
                name = info.filename
                if "/data/sample_inputs/" in name and info.file_size:
                    raise ArtifactError(f"{file} holds pickled example inputs ({name}); refusing to load it")
                if name.endswith("_config.json") and "/data/" in name:
                    config = json.loads(archive.read(name)).get("config", {})
                    pickled = [fqn for fqn, payload in config.items() if payload.get("use_pickle")]
                    if pickled:
                        raise ArtifactError(f"{file} holds pickled payloads ({pickled[:3]}...); refusing to load it")
    except zipfile.BadZipFile as e:
        raise ArtifactError(f"{file} is not a pt2 archive ({e})") from e


def pt2_cache_shapes(ep: torch.export.ExportedProgram) -> dict[str, tuple]:
    """{cache state name: static shape} of the program's cache buffers (step.cache.*)."""
    buffers = ep.graph_signature.inputs_to_buffers
    prefix = "step.cache."
    shapes = {}
    for node in ep.graph.nodes:
        fqn = buffers.get(node.name) if node.op == "placeholder" else None
        if fqn and fqn.startswith(prefix):
            val = node.meta.get("val")
            shapes[fqn[len(prefix):]] = tuple(d if isinstance(d, int) else str(d) for d in getattr(val, "shape", ()))
    return shapes


def load_pt2(file: Path, meta: ExportMetadata) -> tuple[Step, Optional[ProgramShape]]:
    import kivi_ops  # noqa: F401  registers torch.ops.kivi, which the program calls

    check_pt2_has_no_pickles(file)
    ep = torch.export.load(file)
    shape = shape_from_cache(pt2_cache_shapes(ep), f"{file}: cache buffers")
    module = ep.module()
    return (lambda input_ids, input_pos, counts: module(input_ids, input_pos, counts)), shape


# ---------------------------------------------------------------- aoti (AOTInductor)


def save_aoti(ep: torch.export.ExportedProgram, file: Path) -> None:
    from kivi_ops.kernels.decomposed.avx2_byte_loads import install

    install()  # AVX2: the packed codes' loads without a store-forwarding stall (that module's doc)
    torch._inductor.aoti_compile_and_package(ep, package_path=str(file))


_AOTI_SHAPE = re.compile(r"constants_info_\[(\d+)\]\.shape = \{([0-9, ]*)\};")
_AOTI_FQN = re.compile(r'constants_info_\[(\d+)\]\.original_fqn = "([^"]*)";')


def aoti_cache_shapes(file: Path) -> dict[str, tuple]:
    """{cache state name: shape} of the cache constants, as the package's generated wrapper source
    records them (constants_info_[i].shape / .original_fqn); {} if the package has no such source."""
    prefix = "step.cache."
    shapes = {}
    try:
        with zipfile.ZipFile(file) as archive:
            sources = [name for name in archive.namelist() if name.endswith(".wrapper.cpp")]
            if len(sources) != 1:
                return {}
            text = archive.read(sources[0]).decode("utf-8", errors="replace")
    except zipfile.BadZipFile as e:
        raise ArtifactError(f"{file} is not an AOTInductor package ({e})") from e
    dims = {i: tuple(int(d) for d in body.split(",") if d.strip()) for i, body in _AOTI_SHAPE.findall(text)}
    for i, fqn in _AOTI_FQN.findall(text):
        if fqn.startswith(prefix) and i in dims:
            shapes[fqn[len(prefix):]] = dims[i]
    return shapes


def load_aoti(file: Path, meta: ExportMetadata) -> tuple[Step, Optional[ProgramShape]]:
    import kivi_ops  # noqa: F401  the package calls the kivi ops through the dispatcher

    shape = shape_from_cache(aoti_cache_shapes(file), f"{file}: cache constants")
    runner = torch._inductor.aoti_load_package(str(file))
    return (lambda input_ids, input_pos, counts: runner(input_ids, input_pos, counts)), shape


# ---------------------------------------------------------------- onnx (onnxruntime)


def save_onnx(ep: torch.export.ExportedProgram, file: Path) -> list[str]:
    """ONNX has no mutable state: the program takes the cache as inputs and returns the updated
    cache (decoder.cache_as_io). Returns the names of the extra files written (external data)."""
    import onnx

    # optimize=False: onnxscript's pattern rewriter took over 10 minutes on this graph (30 layers
    # of cache math); onnxruntime applies its own graph optimizations when it loads the model.
    program = torch.onnx.export(ep, dynamo=True, verbose=False, optimize=False)
    program.save(str(file), external_data=True)
    onnx.checker.check_model(str(file), full_check=False)
    data = file.with_name(file.name + PROGRAM_DATA_SUFFIX)
    return [data.name] if data.exists() else []


def load_onnx(file: Path, meta: ExportMetadata) -> tuple[Step, Optional[ProgramShape]]:
    import numpy as np
    import onnxruntime as ort

    try:
        session = ort.InferenceSession(str(file), providers=["CPUExecutionProvider"])
    except Exception as e:  # onnxruntime raises its own exception types for malformed files
        raise ArtifactError(f"{file} is not a loadable ONNX model ({e})") from e
    inputs = session.get_inputs()
    if len(inputs) != 3 + len(meta.cache_names):
        raise ArtifactError(f"{file} takes {len(inputs)} inputs; its metadata describes {3 + len(meta.cache_names)}")
    numpy_dtypes = {"tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(int64)": np.int64,
                    "tensor(uint8)": np.uint8, "tensor(int16)": np.int16, "tensor(bfloat16)": None}
    cache = []
    for arg in inputs[3:]:
        dtype = numpy_dtypes.get(arg.type)
        if dtype is None:
            raise ArtifactError(f"{file}: cache input {arg.name} has unsupported type {arg.type}")
        if not all(isinstance(d, int) and d > 0 for d in arg.shape):
            raise ArtifactError(f"{file}: cache input {arg.name} has shape {arg.shape}; a KIVI export's cache is static")
        cache.append(np.zeros(arg.shape, dtype=dtype))
    names = [arg.name for arg in inputs]
    # The cache inputs come in metadata.cache_names order (decoder.cache_as_io).
    shape = shape_from_cache({name: tuple(arg.shape) for name, arg in zip(meta.cache_names, inputs[3:])},
                             f"{file}: cache inputs")
    batch = inputs[0].shape[0] if inputs[0].shape else None
    if shape is not None and batch != shape.batch_size:
        raise ArtifactError(f"{file}: input_ids has batch dim {batch!r}, the cache inputs {shape.batch_size}")

    def step(input_ids, input_pos, counts):
        feeds = dict(zip(names, [input_ids.numpy(), input_pos.numpy(), counts.numpy(), *cache]))
        logits, *new_cache = session.run(None, feeds)
        cache[:] = new_cache
        return torch.from_numpy(logits)

    return step, shape


# ---------------------------------------------------------------- pte (ExecuTorch)


def save_pte(ep: torch.export.ExportedProgram, file: Path) -> None:
    from executorch.exir import ExecutorchBackendConfig, to_edge_transform_and_lower

    # Portable kernels only: the XNNPACK partitioner (executorch 1.5.1) refused this graph
    # ("Output node 'aten_add_tensor' is already in the inputs": pass-through arguments) and
    # took minutes on the way. The cache buffers start as zeros, as a fresh cache does.
    edge = to_edge_transform_and_lower(ep)
    file.write_bytes(edge.to_executorch(ExecutorchBackendConfig()).buffer)


def load_pte(file: Path, meta: ExportMetadata) -> tuple[Step, Optional[ProgramShape]]:
    try:
        from executorch.runtime import Runtime
    except ImportError as e:
        raise ArtifactError(f"running a pte export needs the executorch package ({e}); pip install 'kivi-ops[pte]'") from e
    method = Runtime.get().load_program(str(file)).load_method("forward")
    # input_ids is dynamic up to the cache capacity: its planned (upper-bound) sizes are [B, max_seq_len].
    sizes = tuple(method.metadata.input_tensor_meta(0).sizes())
    if len(sizes) != 2 or not all(isinstance(d, int) and d > 0 for d in sizes):
        raise ArtifactError(f"{file}: input_ids has planned sizes {list(sizes)}; expected [batch, max_seq_len]")
    shape = ProgramShape(batch_size=sizes[0], max_seq_len=sizes[1], source=f"{file}: input_ids upper bound")
    return (lambda input_ids, input_pos, counts: method.execute([input_ids, input_pos, counts])[0]), shape
