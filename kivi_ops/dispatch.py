"""The one place that decides which implementation of a cache op runs.

`choose` maps (op, device, mode, q_len, the layer's options) to an implementation; `run` runs it.
KIVICache asks once per call (eager, or while torch.compile / torch.export trace it); the
kivi ops' own device kernels ask again for what runs inside the op. Nothing else chooses.

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
[2] triton_split when head_dim is not a power of two, and where the installed Triton cannot
    compile triton_decode (decode_kernel_compiles). Both attention kernels read the sparse
    store, nuq levels, pre-RoPE keys and the pool. The tensor-core candidate
    (lab/triton_decode_mma.py) is not chosen: on an H200 it was slower than triton_decode with
    MHA, faster with GQA 4:1, and wrong on 5 of its CUDA tests (benchmarks/results/h200/).
    With KIVI_CUDA_DECODE=cuda_cpp (set_cuda_decode), the CUDA C++ tensor-core kernel
    (kivi_ops/cuda, "cuda_cpp") for the calls it supports (cuda/attend.py: plain KIVI-2, fp16,
    head_dim 64/128, G % 32 == 0, <= 8 query heads per kv head, not paged); Triton elsewhere.
    Not the default: no GPU has run or timed it yet (docs/performance.md, "The CUDA C++ route").
[3] decomposed, with the key flush under torch.cond: on CPU Inductor makes it a host-side `if`,
    so a decode step quantizes a key window only on the steps that complete one.
[4] One-token appends and decode attention (q_len == 1) run the compile-mode forms, compiled
    per op outside any traced graph (Choice.compiled; kernels/cpu_compiled.py). Longer appends
    (prompts), and everything with KIVI_CPU_KERNELS=reference, run the reference inside the op.
    The op's own CPU kernel is always the reference (an exported program calling it runs it).
Other devices run the reference inside the op (the op's CPU kernel is the only other one
registered), which is what the dispatcher would do anyway.

Paged layers (paged.py; `pages`, a paged_layout.Paging, is given) follow the same matrix with the
paged form of each implementation: the ops kivi::paged_append / paged_attend (paged_ops.py);
reference: kernels/paged_reference.py; decomposed appends write through the block table;
decomposed_fused reads the pages through it inside its loops (paged_layout.indexed_view),
decomposed_materialized reads them gathered into the static layout (paged_layout.static_view); the
Triton kernels take the block table (kernels/triton_paging.py). The sink/OTT pool and the sparse
store are refused by the paged layer, so footnotes [1] and [2] reduce to nuq levels and pre-RoPE.
"""

from __future__ import annotations

import contextlib
import functools
import os
from typing import NamedTuple, Optional

import torch

from .layout import LayerTensors, QuantParams
from .paged_layout import Paging

OPS = ("append", "attend")
MODES = ("eager", "compile", "export", "portable")
IMPLEMENTATIONS = ("reference", "decomposed", "decomposed_cond", "decomposed_fused", "decomposed_materialized", "triton",
                   "triton_decode", "triton_split", "cuda_cpp")


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


# The CUDA decode attention kernel: "triton" (default, and the fallback for every call cuda_cpp does
# not support) or "cuda_cpp", the CUDA C++ tensor-core kernel (kivi_ops/cuda), opt-in until a GPU
# has checked and timed it. The environment variable is read at import; asking for cuda_cpp where
# it cannot be built raises CudaKernelUnavailable when the setting is made (set_cuda_decode) or,
# from the environment, at the first CUDA decode call.
CUDA_DECODE = ("triton", "cuda_cpp")


_cuda_decode = _from_environment("KIVI_CUDA_DECODE", CUDA_DECODE)


def set_cuda_decode(name: str) -> str:
    """Select the CUDA decode attention kernel for the whole process ("triton" or "cuda_cpp");
    returns the previous selection. cuda_cpp is built here and refused (CudaKernelUnavailable,
    with the reason) where it cannot be."""
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


def _cuda_cpp_takes(layer: LayerTensors, params: Optional[QuantParams], q_len: int, paged: bool,
                    query_heads: Optional[int]) -> bool:
    """Whether the CUDA C++ decode kernel runs this call: asked for, and the call is one it supports.
    Asked for but not buildable: CudaKernelUnavailable (a setting is never silently ignored)."""
    if _cuda_decode != "cuda_cpp" or params is None or query_heads is None or paged:
        return False
    from .cuda.attend import unsupported
    from .cuda.loader import load

    load()
    return unsupported(layer, params, q_len, query_heads) is None


class Choice(NamedTuple):
    implementation: str
    in_op: bool  # runs inside the kivi custom op (its device kernel), rather than traced inline
    compiled: bool = False  # an inline form run through torch.compile on its own (footnote [4])


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
           cpu_kernels: str = "compiled", params: Optional[QuantParams] = None, paged: bool = False,
           query_heads: Optional[int] = None) -> Choice:
    """The implementation of `op` for one call (the support matrix above; cpu_kernels: footnote [4]).
    params / paged / query_heads: the call's settings, whether the layer is paged, the query's heads;
    the CUDA C++ decode kernel (footnote [2]) is chosen only with params and query_heads, unpaged."""
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
        if op == "attend" and _cuda_cpp_takes(layer, params, q_len, paged, query_heads):
            return Choice("cuda_cpp", in_op=True)
        head_dim = layer.k_res.shape[-1]
        decode = q_len == 1 and head_dim & (head_dim - 1) == 0 and decode_kernel_compiles(layer)
        return Choice("triton_decode" if decode else "triton_split", in_op=True)
    eager_decode = mode == "eager" and q_len == 1 and cpu_kernels == "compiled"
    if device == "cpu" and (mode == "compile" or eager_decode):
        compiled = mode == "eager"
        if op == "append":
            return Choice("decomposed_cond", in_op=False, compiled=compiled)
        form = "decomposed_fused" if q_len == 1 and not kvquant else "decomposed_materialized"
        return Choice(form, in_op=False, compiled=compiled)
    return Choice("reference", in_op=True)


@functools.cache
def _triton_older_than(major: int, minor: int) -> bool:
    from importlib.metadata import version

    installed = tuple(int(part) for part in version("triton").split(".")[:2])
    return installed < (major, minor)


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


def append(layer: LayerTensors, key, value, counts, params: QuantParams, *, portable: bool = False,
           pages: Optional[Paging] = None) -> None:
    """cache_append as the cache calls it: through the kivi op, or a decomposed form traced inline.
    pages: the layer is paged (kivi::paged_append and the paged forms)."""
    choice = choose("append", device=key.device.type, mode=current_mode(portable), q_len=key.shape[2], layer=layer,
                    cpu_kernels=_cpu_kernels)
    paged = pages is not None
    if choice.in_op and paged:
        torch.ops.kivi.paged_append(*layer, pages.block_table, key, value, counts, *params)
    elif choice.in_op:
        torch.ops.kivi.cache_append(*layer, key, value, counts, *params)
    elif choice.compiled:
        from .kernels import cpu_compiled

        cpu_compiled.append(append_implementation(choice.implementation, paged), layer, key, value, counts, params,
                            pages)
    else:
        run_append(choice.implementation, layer, key, value, counts, params, pages=pages)


def attend(query, layer: LayerTensors, counts, params: QuantParams, scale: float, *, portable: bool = False,
           pages: Optional[Paging] = None):
    """cache_attend as the cache calls it (pages: the layer is paged). On CUDA this is always the
    op; its kernel (ops.py) asks choose again with params and query_heads, which is where the CUDA
    C++ kernel can be chosen: traced code (torch.compile, export) never touches the extension."""
    choice = choose("attend", device=query.device.type, mode=current_mode(portable), q_len=query.shape[2],
                    layer=layer, cpu_kernels=_cpu_kernels)
    paged = pages is not None
    if choice.in_op and paged:
        return torch.ops.kivi.paged_attend(query, *layer, pages.block_table, counts, *params, scale)
    if choice.in_op:
        return torch.ops.kivi.cache_attend(query, *layer, counts, *params, scale)
    if choice.compiled:
        from .kernels import cpu_compiled

        return cpu_compiled.attend(attend_implementation(choice.implementation, paged), query, layer, counts, params,
                                   scale, pages)
    return run_attend(choice.implementation, query, layer, counts, params, scale, pages=pages)


@functools.cache
def append_implementation(implementation: str, paged: bool = False):
    """The function of one append implementation (imported on first use: Triton only where it
    runs), the same object on every call. paged: its paged form, which takes the Paging as a
    last argument."""
    if paged:
        from .kernels import paged_forms

        return paged_forms.append_form(implementation)
    if implementation == "reference":
        from .kernels.reference import append_reference as fn
    elif implementation in ("decomposed", "decomposed_cond"):
        from .kernels.decomposed_append import append_decomposed

        fn = functools.partial(append_decomposed, flush_under_cond=implementation == "decomposed_cond")
    elif implementation == "triton":
        from .kernels.triton_append import append_triton as fn
    else:
        raise ValueError(f"no append implementation {implementation!r}")
    return fn


@functools.cache
def attend_implementation(implementation: str, paged: bool = False):
    """The function of one attention implementation (paged: its paged form, see append_implementation)."""
    if paged:
        from .kernels import paged_forms

        return paged_forms.attend_form(implementation)
    if implementation == "reference":
        from .kernels.reference import attend_reference as fn
    elif implementation == "decomposed_fused":
        from .kernels.decomposed_attend import attend_fused as fn
    elif implementation == "decomposed_materialized":
        from .kernels.decomposed_attend import attend_materialized as fn
    elif implementation == "triton_decode":
        from .kernels.triton_decode import attend_decode as fn
    elif implementation == "triton_split":
        from .kernels.triton_split import attend_split as fn
    elif implementation == "cuda_cpp":
        from .cuda.attend import attend_cuda_cpp as fn
    else:
        raise ValueError(f"no attend implementation {implementation!r}")
    return fn


def run_append(implementation: str, layer: LayerTensors, key, value, counts, params: QuantParams, *,
               pages: Optional[Paging] = None) -> None:
    """Run one append implementation (its paged form when pages is given)."""
    if pages is None:
        append_implementation(implementation)(layer, key, value, counts, params)
    else:
        append_implementation(implementation, True)(layer, key, value, counts, params, pages)


def run_attend(implementation: str, query, layer: LayerTensors, counts, params: QuantParams, scale: float, *,
               pages: Optional[Paging] = None):
    """Run one attention implementation (its paged form when pages is given)."""
    if pages is None:
        return attend_implementation(implementation)(query, layer, counts, params, scale)
    return attend_implementation(implementation, True)(query, layer, counts, params, scale, pages)
