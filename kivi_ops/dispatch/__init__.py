"""The one place that decides which implementation of a cache op runs: a layer asks `choose` once per
call, and the op runs the answer without choosing again (the support matrix: docs/design.md)."""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Callable, NamedTuple, Optional

import torch

from . import tuning
from ..kernels.cuda.attend import unsupported as cuda_cpp_unsupported
from .implementations import OPS, run_attend
from ..layout import LayerTensors, QuantParams
from ..paged_layout import Paging

log = logging.getLogger(__name__)

MODES = ("eager", "compile", "export", "portable")


CPU_KERNELS = ("compiled", "reference")


def _from_environment(variable: str, allowed: tuple[str, ...]) -> str:
    """The variable's value (default: the first allowed); an unknown one is refused at import."""
    name = os.environ.get(variable, allowed[0])
    if name not in allowed:
        raise ValueError(f"the environment variable {variable} must be one of {allowed}, got {name!r}")
    return name


_cpu_kernels = _from_environment("KIVI_CPU_KERNELS", CPU_KERNELS)


def set_cpu_kernels(name: str) -> str:
    """KIVI_CPU_KERNELS for the whole process; returns the previous one."""
    global _cpu_kernels
    if name not in CPU_KERNELS:
        raise ValueError(f"cpu kernels must be one of {CPU_KERNELS}, got {name!r}")
    previous, _cpu_kernels = _cpu_kernels, name
    return previous


@contextlib.contextmanager
def cpu_kernels(name: str):
    previous = set_cpu_kernels(name)
    try:
        yield
    finally:
        set_cpu_kernels(previous)


def current_cpu_kernels() -> str:
    return _cpu_kernels


# KIVI_CUDA_DECODE: a cuda_cpp that cannot be built is refused, never ignored.
CUDA_DECODE = ("auto", "triton", "cuda_cpp")


_cuda_decode = _from_environment("KIVI_CUDA_DECODE", CUDA_DECODE)


def set_cuda_decode(name: str) -> str:
    """KIVI_CUDA_DECODE for the whole process; returns the previous one."""
    global _cuda_decode
    if name not in CUDA_DECODE:
        raise ValueError(f"cuda decode must be one of {CUDA_DECODE}, got {name!r}")
    if name == "cuda_cpp":
        from ..kernels.cuda.loader import load

        load()
    previous, _cuda_decode = _cuda_decode, name
    return previous


def current_cuda_decode() -> str:
    return _cuda_decode


# The C++ kernel's split counts the autotune tries: its default, 1 (fastest at 1K on the H200), 16.
CUDA_CPP_SPLITS = (None, 1, 16)


def _cuda_cpp_supports(layer: LayerTensors, params: QuantParams, q_len: int, query_heads: int, paged: bool) -> bool:
    return cuda_cpp_unsupported(layer, params, q_len, query_heads, paged=paged) is None


_cuda_cpp_loads: Optional[bool] = None


def _cuda_cpp_available() -> bool:
    """Whether the CUDA C++ kernel loads in this process (asked once; why not, logged once)."""
    global _cuda_cpp_loads
    if _cuda_cpp_loads is None:
        from ..kernels.cuda.loader import load
        from ..kernels.cuda.toolkit import CudaKernelUnavailable

        try:
            load()
            _cuda_cpp_loads = True
        except CudaKernelUnavailable as e:
            log.info("the CUDA C++ decode kernel is not eligible for autotuning in this process: %s", e)
            _cuda_cpp_loads = False
    return _cuda_cpp_loads


def decode_candidates(layer: LayerTensors, params: QuantParams, query_heads: int, paged: bool,
                      triton_rule: str) -> list[tuning.Candidate]:
    if _cuda_decode == "triton":
        return [tuning.Candidate(triton_rule)]
    if _cuda_decode == "cuda_cpp":
        from ..kernels.cuda.loader import load

        load()
        supported = _cuda_cpp_supports(layer, params, 1, query_heads, paged)
        return [tuning.Candidate("cuda_cpp" if supported else triton_rule)]
    found = [tuning.Candidate(name) for name in dict.fromkeys((triton_rule, "triton_split"))]
    if _cuda_cpp_supports(layer, params, 1, query_heads, paged) and _cuda_cpp_available():
        found += [tuning.Candidate("cuda_cpp", () if n is None else (("num_splits", n),)) for n in CUDA_CPP_SPLITS]
    return found


_tuner = tuning.Tuner(tuning.read_table())


def tuned_choice(default: str, layer: LayerTensors, params: QuantParams, query_heads: int, paged: bool,
                 context: Optional[int] = None, measure: Optional[Callable[[Choice], object]] = None) -> Choice:
    """The only eligible kernel, or the tuner's pick for the call's shape class (`default` where none)."""
    candidates = decode_candidates(layer, params, query_heads, paged, default)
    if len(candidates) > 1:
        B, H = layer.k_res.shape[:2]
        cls = tuning.shape_class(batch=B, kv_heads=H, context=layer.k_codes.shape[2] if context is None else context,
                                 query_heads=query_heads, head_dim=layer.k_res.shape[-1], k_bits=params.k_bits,
                                 v_bits=params.v_bits, dtype=layer.k_res.dtype, paged=paged)
        run = None if measure is None else (lambda c: measure(Choice(c.implementation, True, launch=c.launch)))
        pick = _tuner.pick(cls, candidates, tuning.Candidate(default), run)
    else:
        pick = candidates[0]
    return Choice(pick.implementation, in_op=True, launch=pick.launch)


def tuned_attend(default: str, query, layer: LayerTensors, counts, params: QuantParams, scale: float, *,
                 pages: Optional[Paging] = None):
    """A CUDA decode call inside the attention ops: tuned_choice's kernel, timed on these inputs if needed."""
    def run(choice: Choice):
        return run_attend(choice.implementation, query, layer, counts, params, scale, pages=pages,
                          launch=choice.launch)

    return run(tuned_choice(default, layer, params, query.shape[1], pages is not None,
                            None if pages is None else pages.capacity, run))


class Choice(NamedTuple):
    implementation: str
    in_op: bool  # runs inside the kivi custom op, rather than traced inline
    compiled: bool = False  # an inline form compiled on its own
    launch: tuple = ()
    tune: bool = False  # a CUDA decode call: the op runs the tuner's pick


def current_mode(portable: bool) -> str:
    if portable:
        return "portable"
    if torch.compiler.is_exporting():
        return "export"
    if torch.compiler.is_compiling():
        return "compile"
    return "eager"


def choose(op: str, *, device: str, mode: str, q_len: int, layer: LayerTensors,
           cpu_kernels: str = "compiled") -> Choice:
    """The implementation of `op` for one call; a CUDA decode call is marked `tune` (tuned_attend)."""
    if op not in OPS:
        raise ValueError(f"op must be one of {OPS}, got {op!r}")
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if cpu_kernels not in CPU_KERNELS:
        raise ValueError(f"cpu_kernels must be one of {CPU_KERNELS}, got {cpu_kernels!r}")
    kvquant = layer.extras.active if op == "attend" else False
    if mode == "portable":
        return Choice("decomposed" if op == "append" else "decomposed_materialized", in_op=False)
    if device == "cuda":
        if op == "append":
            return Choice("triton", in_op=True)
        head_dim = layer.k_res.shape[-1]
        decode = q_len == 1 and head_dim & (head_dim - 1) == 0 and decode_kernel_compiles(layer)
        return Choice("triton_decode" if decode else "triton_split", in_op=True, tune=q_len == 1)
    eager_decode = mode == "eager" and q_len == 1 and cpu_kernels == "compiled"
    if device == "cpu" and (mode == "compile" or eager_decode):
        compiled = mode == "eager"
        if op == "append":
            return Choice("decomposed_cond", in_op=False, compiled=compiled)
        form = "decomposed_fused" if q_len == 1 and not kvquant else "decomposed_materialized"
        return Choice(form, in_op=False, compiled=compiled)
    return Choice("reference", in_op=True)


def _installed_triton() -> Optional[tuple[int, int]]:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return tuple(int(part) for part in version("triton").split(".")[:2])
    except PackageNotFoundError:
        return None


# Read at import (not functools.cache): decode_kernel_compiles runs inside traced code.
_TRITON = _installed_triton()


def _triton_older_than(major: int, minor: int) -> bool:
    return _TRITON is not None and _TRITON < (major, minor)


def decode_kernel_compiles(layer: LayerTensors) -> bool:
    """Triton before 3.8 cannot compile triton_decode with pre-RoPE keys and a pool in fp16/bf16
    ("operand #0 does not dominate this use"): such layers use triton_split."""
    rope_and_pool = layer.rope_inv_freq is not None and layer.pool is not None
    return not (rope_and_pool and layer.k_res.dtype != torch.float32 and _triton_older_than(3, 8))


def _plain_layer(head_dim: int) -> LayerTensors:
    """Plain-KIVI meta tensors: choose reads shapes and which options are on, nothing else."""
    shape_only = torch.empty((1, 1, 1, head_dim), device="meta")
    return LayerTensors(*[shape_only] * len(LayerTensors._fields[:9]))


def compiled_decode(device: str, head_dim: int = 128) -> dict[str, str]:
    """What a compiled plain-KIVI decode step runs on `device`, per op."""
    layer = _plain_layer(head_dim)
    return {op: choose(op, device=device, mode="compile", q_len=1, layer=layer).implementation for op in OPS}


def support_matrix() -> str:
    """docs/design.md's support matrix as Markdown: choose's answers for a plain layer, equal rows merged."""
    layer = _plain_layer(128)

    def cell(op: str, device: str, mode: str, q_len: int) -> str:
        choice = choose(op, device=device, mode=mode, q_len=q_len, layer=layer)
        return choice.implementation + (" (op)" if choice.in_op else "")

    groups: dict[tuple[str, ...], list[tuple[str, str]]] = {}
    for device in ("cpu", "cuda"):
        for mode in MODES:
            cells = (cell("append", device, mode, 1), cell("attend", device, mode, 1), cell("attend", device, mode, 2))
            groups.setdefault(cells, []).append((device, mode))
    lines = ["| device | mode | append | attend, q_len = 1 | attend, q_len > 1 |", "|---|---|---|---|---|"]
    for cells, where in groups.items():
        modes = {device: [m for d, m in where if d == device] for device, _ in where}
        same = len(modes) > 1 and len({tuple(m) for m in modes.values()}) == 1
        for device, its_modes in ({"any": next(iter(modes.values()))} if same else modes).items():
            lines.append(f"| {device} | {', '.join(its_modes)} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
