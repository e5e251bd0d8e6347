"""Builds and loads the CUDA C++ decode kernel through torch.utils.cpp_extension.load, once per machine,
for the current device's architecture; `load()` raises CudaKernelUnavailable saying why it cannot."""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Optional

import torch

from .toolkit import CudaKernelUnavailable, toolkit_root

HERE = Path(__file__).resolve().parent
SOURCES = (HERE / "binding.cpp", HERE / "decode_attend.cu")
EXTENSION_NAME = "kivi_cuda_decode"
MIN_CAPABILITY = (8, 0)  # mma.sync.m16n8k16 with fp16 or bf16 inputs and fp32 accumulators, fma.rn.bf16x2


def unavailable_reason() -> Optional[str]:
    if torch.version.cuda is None:
        return f"needs a CUDA build of torch (this is {torch.__version__}, torch.version.cuda is None)"
    if not torch.cuda.is_available():
        return "needs a CUDA GPU (torch.cuda.is_available() is False)"
    capability = torch.cuda.get_device_capability()
    if capability < MIN_CAPABILITY:
        return f"needs compute capability >= 8.0 for mma.sync m16n8k16, this GPU has {capability[0]}.{capability[1]}"
    try:
        toolkit_root()
    except CudaKernelUnavailable as e:
        return str(e)
    return None


def arch_list() -> str:
    major, minor = torch.cuda.get_device_capability()
    return f"{major}.{minor}a" if (major, minor) == (9, 0) else f"{major}.{minor}"


@functools.cache
def _build():
    from torch.utils import cpp_extension

    root = toolkit_root()
    cpp_extension.CUDA_HOME = str(root)  # the PyPI toolkit is not on PATH
    lib = root / ("lib64" if (root / "lib64").is_dir() else "lib")
    saved = os.environ.get("TORCH_CUDA_ARCH_LIST")
    os.environ["TORCH_CUDA_ARCH_LIST"] = arch_list()
    try:
        return cpp_extension.load(name=EXTENSION_NAME, sources=[str(s) for s in SOURCES],
                                  extra_cflags=["-O3"],
                                  extra_cuda_cflags=["-O3", "-Xptxas", "-v"],
                                  extra_ldflags=[f"-L{lib}"], verbose=False)
    finally:
        if saved is None:
            os.environ.pop("TORCH_CUDA_ARCH_LIST", None)
        else:
            os.environ["TORCH_CUDA_ARCH_LIST"] = saved


@functools.cache
def _prebuilt(path: str):
    from .prebuilt import Library

    return Library(Path(path))


def load():
    """The built extension, or with KIVI_CUDA_DECODE_LIB=path the library prebuilt.py built."""
    global _loaded
    if _loaded is not None:
        return _loaded
    _loaded = _load()
    return _loaded


_loaded = None


def _load():
    library = os.environ.get("KIVI_CUDA_DECODE_LIB")
    if library:
        if torch.version.cuda is None or not torch.cuda.is_available():
            raise CudaKernelUnavailable("the CUDA C++ decode kernel is unavailable: needs a CUDA GPU and a CUDA build "
                                        f"of torch (this is {torch.__version__})")
        return _prebuilt(library)
    reason = unavailable_reason()
    if reason is not None:
        raise CudaKernelUnavailable(f"the CUDA C++ decode kernel is unavailable: {reason}")
    try:
        return _build()
    except Exception as e:
        raise CudaKernelUnavailable(f"the CUDA C++ decode kernel failed to build: {e}") from e
