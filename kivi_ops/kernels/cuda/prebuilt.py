"""The CUDA decode kernel as a shared library built by plain nvcc without a GPU, called through ctypes:
for a GPU machine with no CUDA compiler (docs/performance.md, Build). Does what binding.cpp does."""

from __future__ import annotations

import ctypes
import subprocess
from pathlib import Path

import torch

from .toolkit import CudaKernelUnavailable, compile_env, tool, toolkit_root

SOURCE = Path(__file__).resolve().parent / "decode_attend.cu"
LOG2E = 1.4426950408889634


class DecodeParams(ctypes.Structure):
    """decode_attend.h's DecodeParams, field for field (x86-64 layout)."""
    _fields_ = [(name, ctypes.c_void_p) for name in (
        "q", "k_codes", "k_scale", "k_zero", "k_res", "v_codes", "v_scale", "v_zero", "v_res", "lengths", "counts",
        "part_acc", "part_ml", "out", "block_table")] + [(name, ctypes.c_int) for name in (
        "batch", "kv_heads", "qg", "max_tokens", "slots", "residual", "group", "head_dim", "num_splits",
        "ott_policy", "max_pages", "page_size", "num_pages", "k_bits", "v_bits")] + [("qscale", ctypes.c_float),
                                                                                    ("bf16", ctypes.c_int)]


def build(path: Path, arch: str = "sm_90a", defines: tuple[str, ...] = ()) -> Path:
    """Compile the library as the variant `defines` names (KIVI_DECODE_* macros); returns its path."""
    root = toolkit_root()
    compute = arch.replace("sm_", "compute_")
    run = subprocess.run([str(tool(root, "nvcc")), f"-gencode=arch={compute},code={arch}", "-O3", "-std=c++17",
                          *(f"-D{d}" for d in defines), "-shared", "-Xcompiler", "-fPIC", "--cudart", "static", "-o",
                          str(path), str(SOURCE)],
                         capture_output=True, text=True, env=compile_env(root))
    if run.returncode:
        raise CudaKernelUnavailable(f"nvcc failed to build {path}:\n{run.stderr}")
    return Path(path)


def _check(t: torch.Tensor, name: str, dtype: torch.dtype) -> None:
    if not t.is_cuda or t.dtype != dtype or not t.is_contiguous():
        raise ValueError(f"kivi cuda decode: {name} must be a contiguous CUDA {dtype} tensor, got "
                         f"{t.dtype} on {t.device}{'' if t.is_contiguous() else ' (not contiguous)'}")


class Library:

    def __init__(self, path: Path):
        try:
            self.lib = ctypes.CDLL(str(path))
        except OSError as e:
            raise CudaKernelUnavailable(f"cannot load the prebuilt CUDA decode library {path}: {e}") from e
        self.lib.kivi_decode_attend_launch.argtypes = [ctypes.POINTER(DecodeParams), ctypes.c_void_p]
        self.lib.kivi_decode_attend_launch.restype = ctypes.c_int
        self.path = path

    def variant(self) -> tuple[int, int, int, int]:
        """(stages, residual in the loop, blocks per SM, 16-bit fold) the library was built as."""
        out = [ctypes.c_int() for _ in range(4)]
        self.lib.kivi_decode_variant(*(ctypes.byref(x) for x in out))
        return tuple(x.value for x in out)

    def decode_attend(self, query, k_codes, k_scale, k_zero, k_res, v_codes, v_scale, v_zero, v_res, lengths, counts,
                      group_size, residual_length, ott_policy, scale, num_splits, block_table=None):
        if query.dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"kivi cuda decode: query dtype must be torch.float16 or torch.bfloat16, got {query.dtype}")
        _check(query, "query", query.dtype)
        for t, name in ((k_codes, "k_codes"), (v_codes, "v_codes")):
            _check(t, name, torch.uint8)
        for t, name in ((k_scale, "k_scale"), (k_zero, "k_zero"), (k_res, "k_res"), (v_scale, "v_scale"),
                        (v_zero, "v_zero"), (v_res, "v_res")):
            _check(t, name, query.dtype)
        _check(lengths, "lengths", torch.int64)
        if counts is not None:
            _check(counts, "counts", torch.int64)
        B, Hq, q_len, D = query.shape
        H, rows = k_codes.shape[1:3]  # rows: S, or the page size when paged
        S = rows if block_table is None else block_table.shape[1] * rows
        if block_table is not None:
            _check(block_table, "block_table", torch.int32)
            if block_table.dim() != 2 or block_table.shape[0] != B or rows % group_size:
                raise ValueError(f"kivi cuda decode: block_table must be [{B}, max_pages] and the page size {rows} a "
                                 f"multiple of group_size {group_size}, got {tuple(block_table.shape)}")
        k_bits, v_bits = k_codes.shape[3] * 8 // D, v_codes.shape[3] * 8 // D
        if (q_len != 1 or D not in (64, 128, 256) or {k_bits, v_bits} - {2, 4} or Hq % H or Hq // H > 16
                or group_size % 32):
            raise ValueError(f"kivi cuda decode: unsupported call (query {tuple(query.shape)}, kv heads {H}, "
                             f"codes {tuple(k_codes.shape)}, group_size {group_size})")
        f32 = dict(dtype=torch.float32, device=query.device)
        part_acc = torch.empty(B * Hq, num_splits + 1, D, **f32)
        part_ml = torch.empty(B * Hq, num_splits + 1, 2, **f32)
        out = torch.empty_like(query)
        if B == 0:
            return out
        p = DecodeParams(query.data_ptr(), k_codes.data_ptr(), k_scale.data_ptr(), k_zero.data_ptr(), k_res.data_ptr(),
                         v_codes.data_ptr(), v_scale.data_ptr(), v_zero.data_ptr(), v_res.data_ptr(), lengths.data_ptr(),
                         None if counts is None else counts.data_ptr(), part_acc.data_ptr(), part_ml.data_ptr(),
                         out.data_ptr(), None if block_table is None else block_table.data_ptr(), B, H, Hq // H, S,
                         k_res.shape[2], residual_length, group_size, D, num_splits, ott_policy,
                         0 if block_table is None else block_table.shape[1], 0 if block_table is None else rows,
                         0 if block_table is None else k_codes.shape[0], k_bits, v_bits, scale * LOG2E,
                         int(query.dtype == torch.bfloat16))
        stream = torch.cuda.current_stream(query.device).cuda_stream
        with torch.cuda.device(query.device):
            err = self.lib.kivi_decode_attend_launch(ctypes.byref(p), ctypes.c_void_p(stream))
        if err:
            raise RuntimeError(f"kivi cuda decode: launch failed with cudaError {err} ({self.path})")
        return out
