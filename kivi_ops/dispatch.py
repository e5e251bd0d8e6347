"""The one place that decides which implementation of a cache op runs.

`choose` maps (op, device, mode, q_len, the layer's options) to an implementation. A cache layer
asks once per call (eager, or while torch.compile / torch.export trace it; layer.run_append /
run_attend) and runs it: a form traced inline, or the kivi op, which carries the choice as its
`implementation` argument and whose kernel runs that entry of the implementation table
(implementations.py) without choosing again. Nothing else chooses. A CUDA decode call is marked
`tune`: inside the op the tuner may run a faster eligible kernel for its shape class
(tuned_attend, footnote [2]), the layer's choice being the default.

`KIVI_CPU_KERNELS` (environment, read at import; `set_cpu_kernels` in Python) picks the CPU
decode kernels outside torch.compile: "compiled" (default), the compiled-mode forms compiled per
op (kernels/cpu_compiled.py), or "reference", the reference inside the op. The committed SmolLM2
quality tables were measured with the reference (docs/quality.md says what it reproduces).

Modes: "eager"; "compile" (torch.compile is tracing); "export" (torch.export is tracing: the
custom ops stay in the program, so pt2 and AOTInductor run our kernels); "portable" (the cache
is built for exporters that cannot carry custom ops: ONNX, ExecuTorch).

Support matrix (decomposed forms are core ATen: traced inline, never inside the op):

    device  mode            append                attend, q_len == 1         attend, q_len > 1
    cpu     eager           decomposed_cond [4]   decomposed_fused [1][4]    reference (op)
    cpu     export          reference (op)        reference (op)             reference (op)
    cpu     compile         decomposed_cond [3]   decomposed_fused [1]       decomposed_materialized
    any     portable        decomposed            decomposed_materialized    decomposed_materialized
    cuda    eager, compile, triton (op)           triton_decode (op) [2]     triton_split (op)
            export

[1] decomposed_materialized with nuq levels, the sparse store or pre-RoPE keys (the fused loop
    form covers plain KIVI and the sink/OTT pool).
[2] The Triton rule: triton_split when head_dim is not a power of two, and where the installed
    Triton cannot compile triton_decode (decode_kernel_compiles). Both attention kernels read the
    sparse store, nuq levels, pre-RoPE keys and the pool. Inside the op (ops.py, paged_ops.py:
    tuned_attend), a decode call (q_len == 1, `tune`) runs the kernel picked for its shape class
    among the eligible ones, with KIVI_CUDA_DECODE (set_cuda_decode) at its default "auto" (tuning.py):
      eligible  the Triton rule's kernel, triton_split, and the CUDA C++ tensor-core kernel
                (kivi_ops/cuda, "cuda_cpp") with each of CUDA_CPP_SPLITS split counts, where
                cuda/attend.py `unsupported` takes the call and the extension loads (else not
                eligible, logged once). It takes 2- and 4-bit keys and values, fp16 and bf16,
                head_dim 64/128/256, G % 32 == 0, <= 16 query heads per kv head, static or paged;
                what falls back to Triton (cuda/attend.py lists each reason): the sink/OTT pool,
                KVQuant parts (nuq, sparse store, pre-RoPE), 3- and 8-bit codes, fp32, other head
                dims, more query heads, q_len > 1.
      picked    from the tuning table (kivi_ops/tuning_table.json, per device name; seeded with the
                2026-11-27 H200 sweep at 1a0a8a9), else by a one-time autotune at first use
                (timed on the call's inputs, CUDA events, median), cached per (device, shape
                class) for the process and logged once. Never timed inside a CUDA-graph capture
                or while torch.compile / export trace: the table's kernel or the Triton rule runs.
    KIVI_CUDA_DECODE=triton runs the Triton rule everywhere; =cuda_cpp the C++ kernel (its default
    splits) for every call it supports, refused with CudaKernelUnavailable where it cannot be built.
    The tensor-core Triton candidate (lab/triton_decode_mma.py) is not eligible: on an H200 it was
    slower than triton_decode with MHA, faster with GQA 4:1, and wrong on 5 of its CUDA tests
    (benchmarks/results/h200/).
[3] decomposed, with the key flush under torch.cond: on CPU Inductor makes it a host-side `if`,
    so a decode step quantizes a key window only on the steps that complete one.
[4] One-token appends and decode attention (q_len == 1) run the compile-mode forms, compiled
    per op outside any traced graph (Choice.compiled; kernels/cpu_compiled.py). Longer appends
    (prompts), and everything with KIVI_CPU_KERNELS=reference, run the reference inside the op.
    The op's own CPU kernel is always the reference (an exported program calling it runs it).
Other devices run the reference inside the op (the op's CPU kernel is the only other one
registered), which is what the dispatcher would do anyway.

Paged layers (paged.py; `pages`, a paged_layout.Paging, is given) follow the same matrix with the
paged form of each implementation (implementations.py) and the ops kivi::paged_append / paged_attend
(paged_ops.py). The sink/OTT pool and the sparse store are refused by the paged layer, so
footnotes [1] and [2] reduce to nuq levels and pre-RoPE.
"""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Callable, NamedTuple, Optional

import torch

from . import tuning
from .cuda.attend import unsupported as cuda_cpp_unsupported
from .implementations import OPS, run_attend
from .layout import LayerTensors, QuantParams
from .paged_layout import Paging

log = logging.getLogger(__name__)

MODES = ("eager", "compile", "export", "portable")


CPU_KERNELS = ("compiled", "reference")


def _from_environment(variable: str, allowed: tuple[str, ...]) -> str:
    """The selection an environment variable makes (default: the first allowed value); an unknown
    value is refused at import, naming the variable and the allowed values."""
    name = os.environ.get(variable, allowed[0])
    if name not in allowed:
        raise ValueError(f"the environment variable {variable} must be one of {allowed}, got {name!r}")
    return name


_cpu_kernels = _from_environment("KIVI_CPU_KERNELS", CPU_KERNELS)


def set_cpu_kernels(name: str) -> str:
    """Select the CPU decode kernels outside torch.compile ("compiled" or "reference", see the
    module doc) for the whole process; returns the previous selection."""
    global _cpu_kernels
    if name not in CPU_KERNELS:
        raise ValueError(f"cpu kernels must be one of {CPU_KERNELS}, got {name!r}")
    previous, _cpu_kernels = _cpu_kernels, name
    return previous


@contextlib.contextmanager
def cpu_kernels(name: str):
    """`with cpu_kernels("reference"):` selects them for the block (set_cpu_kernels, restored after)."""
    previous = set_cpu_kernels(name)
    try:
        yield
    finally:
        set_cpu_kernels(previous)


def current_cpu_kernels() -> str:
    return _cpu_kernels


# The CUDA decode attention kernel (footnote [2]): "auto" (default) picks per shape class from the
# tuning table or a one-time autotune (tuning.py) among the eligible kernels; "triton" forces the
# Triton rule; "cuda_cpp" forces the CUDA C++ kernel for every call it supports (Triton for the
# rest). The environment variable is read at import; asking for cuda_cpp where it cannot be built
# raises CudaKernelUnavailable when the setting is made (set_cuda_decode) or, from the
# environment, at the first CUDA decode call. Under "auto" such a kernel is simply not eligible.
CUDA_DECODE = ("auto", "triton", "cuda_cpp")


_cuda_decode = _from_environment("KIVI_CUDA_DECODE", CUDA_DECODE)


def set_cuda_decode(name: str) -> str:
    """Select the CUDA decode attention kernel for the whole process ("auto", "triton" or
    "cuda_cpp"); returns the previous selection. cuda_cpp is built here and refused
    (CudaKernelUnavailable, with the reason) where it cannot be."""
    global _cuda_decode
    if name not in CUDA_DECODE:
        raise ValueError(f"cuda decode must be one of {CUDA_DECODE}, got {name!r}")
    if name == "cuda_cpp":
        from .cuda.loader import load

        load()
    previous, _cuda_decode = _cuda_decode, name
    return previous


def current_cuda_decode() -> str:
    return _cuda_decode


# Its split counts tried by the autotune: the launcher's default (None, from the static shapes), one
# split (fastest at 1K on the H200) and 16 (the sweep's third point).
CUDA_CPP_SPLITS = (None, 1, 16)


def _cuda_cpp_supports(layer: LayerTensors, params: QuantParams, q_len: int, query_heads: int, paged: bool) -> bool:
    return cuda_cpp_unsupported(layer, params, q_len, query_heads, paged=paged) is None


_cuda_cpp_loads: Optional[bool] = None  # under "auto": whether the extension loads (asked once)


def _cuda_cpp_available() -> bool:
    """Whether the CUDA C++ kernel can be loaded in this process (asked once; why not, logged once)."""
    global _cuda_cpp_loads
    if _cuda_cpp_loads is None:
        from .cuda.loader import load
        from .cuda.toolkit import CudaKernelUnavailable

        try:
            load()
            _cuda_cpp_loads = True
        except CudaKernelUnavailable as e:
            log.info("the CUDA C++ decode kernel is not eligible for autotuning in this process: %s", e)
            _cuda_cpp_loads = False
    return _cuda_cpp_loads


def decode_candidates(layer: LayerTensors, params: QuantParams, query_heads: int, paged: bool,
                      triton_rule: str) -> list[tuning.Candidate]:
    """The kernels eligible for one CUDA decode call under the current KIVI_CUDA_DECODE setting."""
    if _cuda_decode == "triton":
        return [tuning.Candidate(triton_rule)]
    if _cuda_decode == "cuda_cpp":
        from .cuda.loader import load

        load()  # asked for but not buildable: CudaKernelUnavailable (a setting is never silently ignored)
        supported = _cuda_cpp_supports(layer, params, 1, query_heads, paged)
        return [tuning.Candidate("cuda_cpp" if supported else triton_rule)]
    found = [tuning.Candidate(name) for name in dict.fromkeys((triton_rule, "triton_split"))]
    if _cuda_cpp_supports(layer, params, 1, query_heads, paged) and _cuda_cpp_available():
        found += [tuning.Candidate("cuda_cpp", () if n is None else (("num_splits", n),)) for n in CUDA_CPP_SPLITS]
    return found


_tuner = tuning.Tuner(tuning.read_table())


def tuned_choice(default: str, layer: LayerTensors, params: QuantParams, query_heads: int, paged: bool,
                 context: Optional[int] = None, measure: Optional[Callable[[Choice], object]] = None) -> Choice:
    """The CUDA decode-attention kernel for one call (footnote [2]): the only eligible one, or the
    tuner's pick for its shape class, `default` (the Triton rule's kernel) where the tuner has
    none. context: tokens a row holds (default: the static layout's, k_codes' dim 2; a paged
    layer's Paging.capacity). measure(choice) runs a candidate on the call's inputs, for the autotune."""
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
    """A tuned CUDA decode call inside the attention ops (ops.py, paged_ops.py): the tuner's pick
    (tuned_choice; its autotune, if the shape class needs one, times the candidates on these
    inputs), run with its launch settings."""
    def run(choice: Choice):
        return run_attend(choice.implementation, query, layer, counts, params, scale, pages=pages,
                          launch=choice.launch)

    return run(tuned_choice(default, layer, params, query.shape[1], pages is not None,
                            None if pages is None else pages.capacity, run))


class Choice(NamedTuple):
    implementation: str
    in_op: bool  # runs inside the kivi custom op (its device kernel), rather than traced inline
    compiled: bool = False  # an inline form run through torch.compile on its own (footnote [4])
    launch: tuple = ()  # launcher keywords of a tuned device kernel, sorted pairs (cuda_cpp's num_splits)
    tune: bool = False  # a CUDA decode call: the op runs the tuner's pick, this implementation by default


def current_mode(portable: bool) -> str:
    """The mode of the call being made now (see the module doc)."""
    if portable:
        return "portable"
    if torch.compiler.is_exporting():
        return "export"
    if torch.compiler.is_compiling():
        return "compile"
    return "eager"


def choose(op: str, *, device: str, mode: str, q_len: int, layer: LayerTensors,
           cpu_kernels: str = "compiled") -> Choice:
    """The implementation of `op` for one call (the support matrix above; cpu_kernels: footnote [4]).
    A CUDA decode call gets the Triton rule's kernel, marked `tune` (footnote [2]: the op runs the
    tuner's pick, tuned_attend)."""
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
            return Choice("triton", in_op=True)  # every option: the sparse store, the pool, nuq
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
    """Whether the installed Triton compiles triton_decode for this layer. Triton before 3.8
    fails on pre-RoPE keys with a sink/OTT pool in fp16/bf16 (MLIR: "operand #0 does not
    dominate this use"; seen on an H200 with Triton 3.6, and without a GPU by compiling for sm_90,
    while 3.8 compiles it): such a layer decodes with triton_split, which compiles."""
    rope_and_pool = layer.rope_inv_freq is not None and layer.pool is not None
    return not (rope_and_pool and layer.k_res.dtype != torch.float32 and _triton_older_than(3, 8))


def compiled_decode(device: str, head_dim: int = 128) -> dict[str, str]:
    """What a compiled plain-KIVI decode step runs on `device`, per op (for benchmark reports)."""
    shape_only = torch.empty((1, 1, 1, head_dim), device="meta")
    layer = LayerTensors(*[shape_only] * len(LayerTensors._fields[:9]))
    return {op: choose(op, device=device, mode="compile", q_len=1, layer=layer).implementation for op in OPS}
