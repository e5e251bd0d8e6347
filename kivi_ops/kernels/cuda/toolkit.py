"""Where the CUDA compiler is: the PyPI toolkit of the `cuda-build` extra (docs/usage.md), or the system's."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Optional


class CudaKernelUnavailable(RuntimeError):
    """The CUDA C++ decode kernel cannot be built or run here."""


def pip_toolkit_root() -> Optional[Path]:
    try:
        import nvidia  # namespace package of NVIDIA's PyPI wheels
    except ImportError:
        return None
    for base in getattr(nvidia, "__path__", []):
        root = Path(base) / "cu13"
        if (root / "bin" / "nvcc").is_file() and (root / "nvvm" / "bin" / "cicc").is_file():
            return root
    return None


def toolkit_root() -> Path:
    if os.environ.get("CUDA_HOME"):
        root = Path(os.environ["CUDA_HOME"])
        if (root / "bin" / "nvcc").is_file():
            return root
        raise CudaKernelUnavailable(f"CUDA_HOME={root} has no bin/nvcc")
    root = pip_toolkit_root()
    if root is not None:
        return root
    nvcc = shutil.which("nvcc")
    if nvcc:
        return Path(nvcc).resolve().parent.parent
    if Path("/usr/local/cuda/bin/nvcc").is_file():  # CUDA images install here, often off PATH
        return Path("/usr/local/cuda")
    raise CudaKernelUnavailable("no CUDA compiler: install the cuda-build extra (pip install -e '.[cuda-build]') "
                                "or set CUDA_HOME to a CUDA toolkit")


def tool(root: Path, name: str) -> Path:
    path = root / "bin" / name
    if not path.is_file():
        raise CudaKernelUnavailable(f"the CUDA toolkit at {root} has no bin/{name}")
    return path


def compile_env(root: Path) -> dict:
    """nvcc's environment: nvcc.profile finds cicc and headers from bin/, so PATH is the only addition."""
    env = dict(os.environ)
    env["PATH"] = f"{root / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    return env
