"""Writing and loading each export format. A loaded program is a `Step`:

    step(input_ids [B, n] int64, input_pos [B] int64, counts [B] int64) -> logits [B, vocab] (torch)

holding the cache state between calls (export/decoder.py documents the calling convention).
"""

from __future__ import annotations

import json
import zipfile
from pathlib import Path
from typing import Callable

import torch

from .artifact import ArtifactError, ExportMetadata

Step = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


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


def load_pt2(file: Path, meta: ExportMetadata) -> Step:
    import kivi_ops  # noqa: F401  registers torch.ops.kivi, which the program calls

    check_pt2_has_no_pickles(file)
    module = torch.export.load(file).module()
    return lambda input_ids, input_pos, counts: module(input_ids, input_pos, counts)


# ---------------------------------------------------------------- aoti (AOTInductor)


def save_aoti(ep: torch.export.ExportedProgram, file: Path) -> None:
    torch._inductor.aoti_compile_and_package(ep, package_path=str(file))


def load_aoti(file: Path, meta: ExportMetadata) -> Step:
    import kivi_ops  # noqa: F401  the package calls the kivi ops through the dispatcher

    runner = torch._inductor.aoti_load_package(str(file))
    return lambda input_ids, input_pos, counts: runner(input_ids, input_pos, counts)


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
    data = file.with_name(file.name + ".data")
    return [data.name] if data.exists() else []


def load_onnx(file: Path, meta: ExportMetadata) -> Step:
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
        cache.append(np.zeros(arg.shape, dtype=dtype))
    names = [arg.name for arg in inputs]

    def step(input_ids, input_pos, counts):
        feeds = dict(zip(names, [input_ids.numpy(), input_pos.numpy(), counts.numpy(), *cache]))
        logits, *new_cache = session.run(None, feeds)
        cache[:] = new_cache
        return torch.from_numpy(logits)

    return step


# ---------------------------------------------------------------- pte (ExecuTorch)


def save_pte(ep: torch.export.ExportedProgram, file: Path) -> None:
    from executorch.exir import ExecutorchBackendConfig, to_edge_transform_and_lower

    # Portable kernels only: the XNNPACK partitioner (executorch 1.5.1) refused this graph
    # ("Output node 'aten_add_tensor' is already in the inputs": pass-through arguments) and
    # took minutes on the way. The cache buffers start as zeros, as a fresh cache does.
    edge = to_edge_transform_and_lower(ep)
    file.write_bytes(edge.to_executorch(ExecutorchBackendConfig()).buffer)


def load_pte(file: Path, meta: ExportMetadata) -> Step:
    try:
        from executorch.runtime import Runtime
    except ImportError as e:
        raise ArtifactError(f"running a pte export needs the executorch package ({e}); pip install 'kivi-ops[pte]'") from e
    method = Runtime.get().load_program(str(file)).load_method("forward")
    return lambda input_ids, input_pos, counts: method.execute([input_ids, input_pos, counts])[0]
