"""Where the CUDA compiler is: the PyPI toolkit of the `cuda-build` extra, or the system's.

`pip install -e '.[cuda-build]'` brings nvcc 13.5 with its front end (nvidia-nvvm's cicc), the
runtime and CCCL headers, nvdisasm and cuobjdump into site-packages/nvidia/cu13. That compiles
decode_attend.cu for sm_90a on a machine with no GPU and no system CUDA (lab/cuda_decode_model.py).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Optional


class CudaKernelUnavailable(RuntimeError):
    """The CUDA C++ decode kernel cannot be built or run here; the message says why."""


def pip_toolkit_root() -> Optional[Path]:
    """site-packages/nvidia/cu13 when the cuda-build extra's nvcc is installed there, else None."""
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
    """The CUDA toolkit to compile with: $CUDA_HOME, else the PyPI one, else the nvcc on PATH,
    else /usr/local/cuda."""
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
    """A toolkit binary (nvcc, nvdisasm, cuobjdump, ptxas)."""
    path = root / "bin" / name
    if not path.is_file():
        raise CudaKernelUnavailable(f"the CUDA toolkit at {root} has no bin/{name}")
    return path


def compile_env(root: Path) -> dict:
    """The environment nvcc needs: the PyPI layout keeps cicc under nvvm/bin and headers under
    include (nvcc.profile finds both relative to bin/), so PATH is the only addition."""
    env = dict(os.environ)
    env["PATH"] = f"{root / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    return env
