"""The static facts decode_time_model.py prices, compiled for sm_90 without a GPU: registers and
shared memory per kernel configuration, and the loop bodies' warp instructions and pipe cycles.

Triton decode kernel (Triton's ptxas and nvdisasm): the first loop of the SASS is the quantized
tile loop, the second the mixed tile loop (residual tokens; it spills at 1 warp x 32). CUDA C++
kernel (nvcc from the cuda-build extra; Triton's nvdisasm when the toolkit has none): the chunk
loop is the shortest loop with HMMA (as cuda_decode_model.mma_loop), the tail token loop the longest
loop with shuffles and global loads but no HMMA.
"""

from __future__ import annotations

import subprocess
import tempfile
from pathlib import Path

import torch

from kivi_benchmarks.environment import environment

TRITON_CONFIGS = ((1, 32), (4, 16), (4, 32), (8, 32))
HEADS = ((32, 32), (32, 8))


def nvdisasm() -> Path:
    """The toolkit's nvdisasm, or the Triton wheel's (same tool) when the toolkit has none."""
    import triton

    from kivi_ops.kernels.cuda.toolkit import toolkit_root

    own = toolkit_root() / "bin" / "nvdisasm"
    return own if own.exists() else Path(triton.backends.nvidia.__path__[0]) / "bin" / "nvdisasm"


def cuda_cpp_static(arch: str = "sm_90a") -> dict:
    from kivi_ops.kernels.cuda.toolkit import compile_env, tool, toolkit_root

    from .cuda_decode_model import NVCC_FLAGS, SOURCE, functions, ptxas_resources
    from .decode_time_model import loop_of
    from .issue_model import sass_loops

    root = toolkit_root()
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "k.cubin"
        run = subprocess.run([str(tool(root, "nvcc")), f"-gencode=arch={arch.replace('sm_', 'compute_')},code={arch}",
                              *NVCC_FLAGS, "-cubin", "-o", str(cubin), str(SOURCE)], capture_output=True, text=True,
                             env=compile_env(root), check=True)
        sass = subprocess.run([str(nvdisasm()), "-c", str(cubin)], capture_output=True, text=True, check=True).stdout
    name, res = next((n, r) for n, r in ptxas_resources(run.stderr).items()
                     if "split_kernelILi128ELi2ELi2ELb0E6__half" in n or n.endswith("split_kernelILi128EEEvNS_12DecodeParamsE"))
    lines = functions(sass)[name]
    loops = sass_loops(lines)
    chunks = [loop for loop in loops if any(op.startswith("HMMA") for op in loop)]  # the shortest: one chunk
    tails = [loop for loop in loops if not any(op.startswith("HMMA") for op in loop)
             and any(op.startswith("SHFL") for op in loop) and any(op.startswith("LDG") for op in loop)]
    tail = max(tails, key=len)
    # The tail body: per channel, an if/else between the quantized and the residual load (one side
    # runs), then one block per query head of the 8 the MMA tile holds (5 shuffles each; the loop
    # breaks after the row's qg heads). The head blocks are found by their shuffles.
    shuffles = [i for i, op in enumerate(tail) if op.startswith("SHFL")]
    per_head = (shuffles[-1] - shuffles[0] + 1) / 8
    return dict(kernel=name, head_dim=128, registers=res["registers"], shared_bytes=res["shared_bytes"],
                spill_store_bytes=res["spill_store_bytes"], chunk=vars(loop_of(min(chunks, key=len))),
                tail_token=vars(loop_of(tail)), tail_loads_instructions=shuffles[0],
                tail_per_head_instructions=round(per_head, 1))


def triton_decode_static(arch: int = 90, cubin_dir: Path | None = None) -> dict:
    from kivi_ops.kernels.triton.decode import attend_decode

    from .decode_time_model import loop_of
    from .issue_model import sass_loops, sass_of
    from .ptxas_usage import compile_instead_of_launch, layer_of, ptxas_report

    out = {}
    for q_heads, kv_heads in HEADS:
        t, p = layer_of(kv_heads=kv_heads, head_dim=128, bits=2, tokens=32768 + 256)
        q = torch.randn(1, q_heads, 1, 128, dtype=torch.float16)
        for warps, block_n in TRITON_CONFIGS:
            with compile_instead_of_launch(arch) as compiled:
                attend_decode(q, t, None, p, 0.088, num_splits=8, num_warps=warps, block_n=block_n)
            kernel = compiled[0][1]
            if cubin_dir is not None:  # what this machine's Triton and ptxas built, for a recount elsewhere
                (cubin_dir / f"triton_decode_{q_heads}x{kv_heads}_w{warps}_n{block_n}.cubin").write_bytes(
                    kernel.asm["cubin"])
            loops = sass_loops(sass_of(kernel, arch).splitlines())
            report = ptxas_report(kernel.asm["ptx"], arch)
            out[f"{q_heads}/{kv_heads} w{warps} n{block_n}"] = dict(
                registers=report["registers"], spill_store_bytes=report["spill_store_bytes"],
                shared_bytes=kernel.metadata.shared, quantized_tile=vars(loop_of(loops[0])),
                mixed_tile=vars(loop_of(loops[1])))
    return out


def nvcc_version() -> str:
    from kivi_ops.kernels.cuda.toolkit import tool, toolkit_root

    out = subprocess.run([str(tool(toolkit_root(), "nvcc")), "--version"], capture_output=True, text=True, check=True)
    return next(line for line in out.stdout.splitlines() if "release" in line).strip()


CUDA_SOURCES = ("decode_attend.cu", "decode_attend.h")


def cuda_sources_sha256(read=None) -> str:
    """The digest of the CUDA C++ kernel's sources (kivi_ops/kernels/cuda): the C++ facts describe the source
    they were compiled from. `read(name) -> bytes` reads another revision's files (default: this tree's)."""
    import hashlib

    root = Path(__file__).resolve().parent.parent / "kivi_ops" / "kernels" / "cuda"
    read = read or (lambda name: (root / name).read_bytes())
    digest = hashlib.sha256()
    for name in CUDA_SOURCES:
        digest.update(name.encode() + b"\0" + read(name))
    return digest.hexdigest()


def collect(cubin_dir: Path | None = None, cuda_cpp_from: Path | None = None) -> dict:
    """The static facts compiled on this machine. cubin_dir: also write the Triton cubins there.
    cuda_cpp_from: a static JSON whose CUDA C++ facts are taken where this machine has no nvcc (a GPU
    image running the library prebuilt elsewhere runs exactly the code counted there)."""
    from kivi_ops.kernels.cuda.toolkit import CudaKernelUnavailable

    if cubin_dir is not None:
        cubin_dir.mkdir(parents=True, exist_ok=True)
    try:
        nvcc, cuda_cpp, cuda_note = nvcc_version(), cuda_cpp_static(), "compiled here"
    except (CudaKernelUnavailable, FileNotFoundError, subprocess.CalledProcessError):
        if cuda_cpp_from is None:
            raise
        taken = __import__("json").loads(Path(cuda_cpp_from).read_text())
        nvcc, cuda_cpp = taken["meta"]["nvcc"], taken["cuda_cpp"]
        cuda_note = (f"no nvcc here: the committed facts of {cuda_cpp_from} (the CUDA C++ libraries were "
                     "compiled off this machine)")
    meta = dict(**environment(command="python -m lab decode_time_model --static"), arch="sm_90a", nvcc=nvcc,
                cuda_sources_sha256=cuda_sources_sha256(), cuda_cpp_source=cuda_note,
                note="KIVI-2, G=32, R=128, head_dim 128, fp16; loop bodies counted in SASS, per warp per iteration "
                     "(Triton: one BLOCK_N-token tile; CUDA C++: one 32-token chunk, one tail token)")
    return dict(meta=meta, triton_decode=triton_decode_static(cubin_dir=cubin_dir), cuda_cpp=cuda_cpp)
