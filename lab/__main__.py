"""One way to run a study of the lab, from the repository root:

    .venv/bin/python -m lab                  # the list of studies
    .venv/bin/python -m lab NAME [ARGS...]   # one of them; NAME --help for its arguments

GPU studies (gpu_*) need a CUDA device; lab/gpu_suite.sh runs them with the GPU tests and the
`kivi bench` measurements in one device call.
"""

from __future__ import annotations

import importlib
import sys

STUDIES = {
    "ptxas_usage": "registers, spills and occupancy of every Triton kernel for sm_90, compiled without a GPU",
    "issue_model": "instructions per token of the decode kernels' loops for sm_90, and the bandwidth ceiling they set",
    "cuda_decode_model": "the CUDA C++ decode kernel for sm_90a: ptxas registers/spills and its issue-model ceiling",
    "cuda_decode_variants": "the CUDA C++ kernel's compile-time variants: SASS counts and predicted H200 times",
    "decode_time_model": "decode-attention times on the H200 from static sm_90 facts, calibrated on two runs; predictions",
    "three_bit_packing": "3-bit packings: bytes, CPU (Inductor) unpack cost, Triton decode instructions per token",
    "byte_model": "bytes each decode-path kernel must read against the bytes it loads (Triton interpreter)",
    "compile_modes_cpu": "CPU decode step: one decoder layer compiled for all (regional) vs the whole step",
    "decomposed_attend_cpu": "CPU: compiled decomposed KIVI-2 attention and append vs compiled fp32 SDPA",
    "paged_decode_cpu": "CPU: the compiled paged KIVI decode step (append + attend) vs the static cache's, same rows",
    "decode_buckets_cpu": "CPU: the compiled paged decode step over every row vs over the bucket holding the requests",
    "prefill_chunk_cpu": "CPU: prefilling a prompt in chunks (--prefix-caching) vs one-shot, per chunk size",
    "gpu_attend_sweep": "GPU: decode attention launch configurations (and the tensor-core candidate) vs SDPA",
    "gpu_layer_costs": "GPU: per-layer append, flush step and attend, plain KIVI and with each option",
    "gpu_tune": "GPU: the decode-attention tuning table (kivi_ops/dispatch/tuning_table.json), every eligible kernel timed",
    "gpu_profile_step": "GPU: the graph-replayed 7B-shape decode step's kernels, fp vs KIVI-2 (torch.profiler)",
    "gguf_truncate": "a GGUF model cut to its first N layers (a real-weight test model small enough to carry)",
    "rotation_table": "per-row `kivi eval ppl --json` runs (rotations, per-token / FP8 baselines) into one table + plot",
    "serve_round_shape": "serve/ lines one paged request's rounds execute, and the files on its path (issue 51)",
    "varlen_decode_cpu": "CPU: one KIVI-2 layer's decode step through kivi_ops.cache.varlen (the vLLM backend's) vs fp32 SDPA",
    "vllm_bench_plot": "kivi_vllm.bench's JSON as one figure: each cache against stock vLLM",
    "e2e_rotations": "calibrated rotations trained end to end on a forward quantized as the decode cache (SpinQuant-style)",
    "prose_ratio": "docstring and comment lines as a share of a package's non-blank lines (kivi_ops, serve, models)",
    "gpu_wheels": "the wheels the GPU image lacks for lab/gpu_suite.sh (dependency closure minus the image's list)",
}


def main(argv=None) -> int:
    args = sys.argv[1:] if argv is None else list(argv)
    if not args or args[0] in ("-h", "--help"):
        print(__doc__.strip() + "\n\nstudies:")
        for name, what in STUDIES.items():
            print(f"  {name:<22} {what}")
        return 0
    name = args[0]
    if name not in STUDIES:
        print(f"python -m lab: error: unknown study {name!r}; one of: {', '.join(STUDIES)}", file=sys.stderr)
        return 2
    importlib.import_module(f"lab.{name}").main(args[1:])
    return 0


if __name__ == "__main__":
    sys.exit(main())
