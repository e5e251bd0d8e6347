"""The CUDA C++ decode kernel's compile-time variants (decode_attend.cu's KIVI_DECODE_* macros),
each compiled for sm_90a without a GPU, its loops counted in SASS, and its H200 time predicted by
the calibrated decode_time_model at the GPU sweep's shapes, before any GPU runs it.

Per variant (D = 128, 2-bit keys and values, fp16, static: the sweep's kernel): registers, spills,
shared memory (static + the cp.async ring), the fully quantized chunk loop and, with the residual in
the loop, the mixed chunk loop (warp instructions and busiest-pipe cycles per 32-token chunk). The
launch is the model's (decode_time_model: round trips, instructions, occupancy, the schedule) with
the variant's own counts; what the model still assumes is in ASSUMES.

    .venv/bin/python -m lab cuda_decode_variants [--json out.json] [--md out.md] [--libraries .gpu/variants.tar.xz]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
from pathlib import Path

from kivi_benchmarks.environment import environment
from kivi_ops.kernels.cuda.toolkit import compile_env, tool, toolkit_root

from .cuda_decode_model import NVCC_FLAGS, SOURCE, functions, ptxas_resources
from .decode_time_model import (
    CALIBRATION_JSON, CUDA_CHUNK, CUDA_MAX_SPLITS, CUDA_SPLIT_MIN_TOKENS, CUDA_WARPS, DEVICE, PROLOGUE_ROUND_TRIPS,
    STATIC_JSON, Loop, Params, kivi_counts, load, loop_of, must_read_bytes, predict_us, reduce_launch, resident,
    sdpa_launches, tail_loop,
)
from .decode_time_designs import share
from .issue_model import sass_loops

ROOT = Path(__file__).resolve().parent.parent
OUT_JSON = ROOT / "benchmarks" / "results" / "cuda_decode_variants_sm90.json"
OUT_MD = ROOT / "benchmarks" / "results" / "cuda_decode_variants_sm90.md"
KERNEL = "decode_split_kernelILi128ELi2ELi2ELb0E6__half"  # <D=128, KB=2, VB=2, static, fp16>

# name -> the defines it is built with. blocks4 only changes the host's split count (the same cubin
# as default's; the library reports it, attend.py sizes the grid).
VARIANTS = {
    "default": (),
    "stages2": ("KIVI_DECODE_STAGES=2",),
    "stages4": ("KIVI_DECODE_STAGES=4",),
    "residual": ("KIVI_DECODE_RESIDUAL_IN_LOOP=1",),
    "blocks4": ("KIVI_DECODE_BLOCKS_PER_SM=4",),
    "residual-stages2": ("KIVI_DECODE_STAGES=2", "KIVI_DECODE_RESIDUAL_IN_LOOP=1"),
    "residual-stages4": ("KIVI_DECODE_STAGES=4", "KIVI_DECODE_RESIDUAL_IN_LOOP=1"),
    "residual-stages4-blocks4": ("KIVI_DECODE_STAGES=4", "KIVI_DECODE_RESIDUAL_IN_LOOP=1",
                                 "KIVI_DECODE_BLOCKS_PER_SM=4"),
    "fold16": ("KIVI_DECODE_FOLD16=1",),
    "fold16-residual-stages4-blocks4": ("KIVI_DECODE_FOLD16=1", "KIVI_DECODE_STAGES=4", "KIVI_DECODE_RESIDUAL_IN_LOOP=1",
                                        "KIVI_DECODE_BLOCKS_PER_SM=4"),
    # FOLD16=2: the key codes in magic form (lop3 only), the magic offset and the zero in the scores' start
    "magic": ("KIVI_DECODE_FOLD16=2",),
    "magic-residual-stages4-blocks4": ("KIVI_DECODE_FOLD16=2", "KIVI_DECODE_STAGES=4", "KIVI_DECODE_RESIDUAL_IN_LOOP=1",
                                       "KIVI_DECODE_BLOCKS_PER_SM=4"),
}
# the libraries the GPU suite times (--libraries): 7 x ~30 s of its 10 minutes; the rest are priced only
# (fold16 alone: its fold is timed inside fold16-residual-stages4-blocks4)
GPU_VARIANTS = ("default", "stages4", "residual", "residual-stages4-blocks4", "fold16-residual-stages4-blocks4",
                "magic", "magic-residual-stages4-blocks4")
# (batch, query heads, kv heads, tokens): the suite's sweep (batch 8) and batch 1
SHAPES = [(8, 32, 32, 1024), (8, 32, 32, 32768), (8, 32, 8, 1024), (8, 32, 8, 32768), (1, 32, 32, 1024),
          (1, 32, 32, 32768)]
# The issue's targets at batch 8 (speedup over fp16 SDPA; bandwidth share of the measured copy bandwidth)
TARGETS = {(8, 32, 32, 32768): dict(speedup=4.0, bandwidth=0.75), (8, 32, 32, 1024): dict(speedup=1.0),
           (8, 32, 8, 1024): dict(speedup=1.0), (8, 32, 8, 32768): dict(speedup=3.0)}
ASSUMES = ("a stage ring chunk waits 1 / stages of a round trip (its loads were issued stages - 1 chunks "
           "earlier); a mixed chunk waits a whole round trip (direct loads); every warp of a split walks "
           "ceil(chunks / 4) iterations; one warp CPI for every loop (the calibration's)")


def stage_bytes(D: int = 128, KB: int = 2, VB: int = 2) -> int:
    """decode_attend.cu's Stage<D, KB, VB>::kBytes: codes, a key group's scales and zeros, 32 tokens'
    value scales and zeros (at most D / 32 groups)."""
    return CUDA_CHUNK * D * (KB + VB) // 8 + 2 * 2 * D + 2 * CUDA_CHUNK * 2 * (D // 32)


def stages_built(stages: int, D: int = 128, KB: int = 2, VB: int = 2, limit: int = 64 * 1024) -> int:
    """Stage::kStagesBuilt: the asked stages, halved while the block's ring would pass 64 KB."""
    total = stage_bytes(D, KB, VB)
    return 4 if stages == 4 and 4 * CUDA_WARPS * total <= limit else 2 if stages >= 2 and 2 * CUDA_WARPS * total <= limit else 1


def macros(defines: tuple[str, ...]) -> dict:
    d = dict(d.split("=") for d in defines)
    return dict(stages=int(d.get("KIVI_DECODE_STAGES", 1)), residual_in_loop=d.get("KIVI_DECODE_RESIDUAL_IN_LOOP") == "1",
                blocks_per_sm=int(d.get("KIVI_DECODE_BLOCKS_PER_SM", 2)), fold16=int(d.get("KIVI_DECODE_FOLD16", 0)))


def compile_sass(defines: tuple[str, ...], arch: str = "sm_90a") -> tuple[str, str]:
    root = toolkit_root()
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "k.cubin"
        run = subprocess.run([str(tool(root, "nvcc")), f"-gencode=arch={arch.replace('sm_', 'compute_')},code={arch}",
                              *NVCC_FLAGS, *(f"-D{d}" for d in defines), "-cubin", "-o", str(cubin), str(SOURCE)],
                             capture_output=True, text=True, env=compile_env(root))
        if run.returncode:
            raise RuntimeError(f"nvcc failed for {defines}:\n{run.stderr[-3000:]}")
        sass = subprocess.run([str(tool(root, "nvdisasm")), "-c", str(cubin)], capture_output=True, text=True,
                              check=True).stdout
    return run.stderr, sass


def count(report: str, sass: str, defines: tuple[str, ...]) -> dict:
    """The sweep kernel's resources and loops in one variant's compile."""
    name, res = next((n, r) for n, r in ptxas_resources(report).items() if KERNEL in n)
    loops = sass_loops(functions(sass)[name])
    # the shortest loop with MMAs is the quantized chunk's; the next, with the residual in the loop, the
    # mixed chunk's (the longer ones are the loops around both)
    chunk_loops = sorted((loop for loop in loops if any(op.startswith("HMMA") for op in loop)), key=len)
    m = macros(defines)
    stages = stages_built(m["stages"])
    row = dict(defines=list(defines), **m, stages_built=stages, registers=res["registers"],
               spill_store_bytes=res["spill_store_bytes"], stack_bytes=res["stack_bytes"],
               static_shared_bytes=res["shared_bytes"],
               ring_bytes=stages * CUDA_WARPS * stage_bytes() if stages > 1 else 0,
               query_copy_bytes=8 * 128 * 2 if m["fold16"] == 2 else 0,  # kQ16Bytes: dynamic, after the ring
               chunk=vars(loop_of(chunk_loops[0])), chunk_ldgsts=sum(op.startswith("LDGSTS") for op in chunk_loops[0]))
    if m["residual_in_loop"]:
        row["mixed_chunk"] = vars(loop_of(chunk_loops[1]))
    return row


def variant_launches(v: dict, tail_cfg: dict, B: int, Hq: int, H: int, L: int) -> list[dict]:
    """The variant's launches in the model's terms (decode_time_model.cuda_cpp_launches, with the
    variant's counted loops, ring and split count)."""
    tiles = -(-(Hq // H) // 8)
    splits = max(1, min(-(-v["blocks_per_sm"] * DEVICE["sms"] // (B * H * tiles)), L // CUDA_SPLIT_MIN_TOKENS,
                        CUDA_MAX_SPLITS))
    nqk, nqv = kivi_counts(L)
    c_quant = min(nqk, nqv) // CUDA_CHUNK
    chunks = -(-L // CUDA_CHUNK) if v["residual_in_loop"] else c_quant
    per = -(-chunks // splits)
    chunk, mixed = Loop(**v["chunk"]), Loop(**v["mixed_chunk"]) if v["residual_in_loop"] else None
    programs = []
    for sp in range(splits):
        lo, hi = sp * per, min(sp * per + per, chunks)
        n_quant, n_mixed = max(0, min(hi, c_quant) - lo), max(0, hi - max(lo, c_quant))
        phases = [(PROLOGUE_ROUND_TRIPS, None, 0), (1 / v["stages_built"], chunk, -(-n_quant // CUDA_WARPS))]
        if n_mixed:
            phases.append((1, mixed, -(-n_mixed // CUDA_WARPS)))
        programs += [phases] * (B * H * tiles)
    tail_tokens = 0 if v["residual_in_loop"] else L - c_quant * CUDA_CHUNK
    if tail_tokens:
        programs += [[(PROLOGUE_ROUND_TRIPS, None, 0), (1, tail_loop(tail_cfg, Hq // H), -(-tail_tokens // CUDA_WARPS))]] * (
            B * H * tiles)
    res = resident(v["registers"], CUDA_WARPS, v["static_shared_bytes"] + v["ring_bytes"] + v["query_copy_bytes"])
    return [dict(programs=programs, warps=CUDA_WARPS, resident=res, bytes=must_read_bytes(B, Hq, H, L)),
            reduce_launch(B * Hq)]


def predict(v: dict, tail_cfg: dict, params: Params) -> list[dict]:
    rows = []
    for B, Hq, H, L in SHAPES:
        us = predict_us(variant_launches(v, tail_cfg, B, Hq, H, L), params)
        sdpa = predict_us(sdpa_launches(B, Hq, H, L), params)
        rows.append(dict(batch=B, q_heads=Hq, kv_heads=H, tokens=L, predicted_us=round(us, 1),
                         predicted_sdpa_us=round(sdpa, 1), speedup_vs_sdpa=round(sdpa / us, 2),
                         bandwidth_share=round(share(B, Hq, H, L, us), 3)))
    return rows


def meets(rows: list[dict]) -> bool:
    by = {(r["batch"], r["q_heads"], r["kv_heads"], r["tokens"]): r for r in rows}
    return all(by[s]["speedup_vs_sdpa"] >= t["speedup"] and by[s]["bandwidth_share"] >= t.get("bandwidth", 0)
               for s, t in TARGETS.items())


def target_instructions(v: dict, tail_cfg: dict, params: Params) -> dict:
    """Per target: the largest chunk-loop instruction count (the variant's pipe mix kept, the mixed
    chunk scaled alike) at which the model predicts it met; None where no count meets it."""
    out = {}
    for shape, target in TARGETS.items():
        def ok(n: int) -> bool:
            scaled = dict(v, chunk=dict(instructions=n, sm_cycles=v["chunk"]["sm_cycles"] * n / v["chunk"]["instructions"]))
            if v["residual_in_loop"]:
                f = n / v["chunk"]["instructions"]
                scaled["mixed_chunk"] = dict(instructions=max(1, round(v["mixed_chunk"]["instructions"] * f)),
                                             sm_cycles=v["mixed_chunk"]["sm_cycles"] * f)
            r = predict(scaled, tail_cfg, params)[SHAPES.index(shape)]
            return r["speedup_vs_sdpa"] >= target["speedup"] and r["bandwidth_share"] >= target.get("bandwidth", 0)
        lo, hi = 1, v["chunk"]["instructions"]
        if ok(hi):
            out["x".join(map(str, shape))] = hi
            continue
        if not ok(lo):
            out["x".join(map(str, shape))] = None
            continue
        while hi - lo > 1:  # ok(lo), not ok(hi)
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if ok(mid) else (lo, mid)
        out["x".join(map(str, shape))] = lo
    return out


def measure(arch: str = "sm_90a") -> dict:
    params = Params(**load(CALIBRATION_JSON)["params"])
    tail_cfg = load(STATIC_JSON)["cuda_cpp"]  # the tail token's counts (the model's calibrated kernel)
    compiled: dict[tuple, dict] = {}
    rows = []
    for name, defines in VARIANTS.items():
        device_defines = tuple(d for d in defines if not d.startswith("KIVI_DECODE_BLOCKS_PER_SM"))
        if device_defines not in compiled:
            compiled[device_defines] = count(*compile_sass(device_defines, arch), device_defines)
        v = dict(compiled[device_defines], defines=list(defines), **macros(defines))
        v["predictions"] = predict(v, tail_cfg, params)
        v["meets_targets"] = meets(v["predictions"])
        v["target_chunk_instructions"] = target_instructions(v, tail_cfg, params)
        rows.append(dict(variant=name, **v))
        print(f"{name:<26} chunk {v['chunk']['instructions']:>5} instr"
              + (f", mixed {v['mixed_chunk']['instructions']}" if v["residual_in_loop"] else "")
              + f", {v['registers']} regs, ring {v['ring_bytes']} B: "
              + ", ".join(f"{r['tokens'] // 1024}K {r['q_heads']}/{r['kv_heads']} b{r['batch']} {r['speedup_vs_sdpa']}x"
                          for r in v["predictions"]))
    meta = dict(arch=arch, **environment(command=f"python -m lab cuda_decode_variants --arch {arch}"),
                kernel=KERNEL, nvcc_flags=list(NVCC_FLAGS), params=vars(params), assumes=ASSUMES,
                tail_from=str(STATIC_JSON.relative_to(ROOT)),
                note="predicted before any GPU ran these variants; each row's predictions are at the GPU "
                     "sweep's shapes (head_dim 128, KIVI-2, fp16, G=32, R=128, CUDA-graph replay); compiled "
                     "without a GPU")
    return dict(meta=meta, rows=rows)


def markdown(result: dict) -> str:
    lines = ["# CUDA C++ decode kernel variants: SASS counts and predicted H200 times", "",
             f"`{result['meta']['command']}` at {result['meta'].get('git_sha', '?')[:10]}, predicted before any GPU "
             "ran them. Kernel: head_dim 128, 2-bit keys and values, fp16, static. Model: "
             f"decode_time_model with the committed calibration {result['meta']['params']}.", "",
             "Model assumptions beyond the counts: " + result["meta"]["assumes"] + ".", "",
             "| variant | chunk loop (instr / 32 tokens) | mixed chunk | regs | ring | "
             + " | ".join(f"b{b} {hq}/{h} {L // 1024}K" for b, hq, h, L in SHAPES) + " |",
             "| --- | --- | --- | --- | --- | " + " | ".join("---" for _ in SHAPES) + " |"]
    for r in result["rows"]:
        cells = [f"{p['speedup_vs_sdpa']}x ({p['predicted_us']} us)" for p in r["predictions"]]
        lines.append(f"| {r['variant']} | {r['chunk']['instructions']} | "
                     f"{r['mixed_chunk']['instructions'] if r['residual_in_loop'] else '-'} | {r['registers']} | "
                     f"{r['ring_bytes'] // 1024} KB | " + " | ".join(cells) + " |")
    lines += ["", "Speedups are over fp16 SDPA at the same shape as the model prices it. Chunk-loop instruction "
              "counts at which the model predicts each batch-8 target met (None: no count does):", ""]
    for r in result["rows"]:
        lines.append(f"- {r['variant']}: " + ", ".join(f"{k}: {v}" for k, v in r["target_chunk_instructions"].items()))
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m lab cuda_decode_variants", description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", default="sm_90a")
    parser.add_argument("--json", default=None, help=f"write the rows here (committed: {OUT_JSON.relative_to(ROOT)})")
    parser.add_argument("--md", default=None, help="write the table here")
    parser.add_argument("--libraries", default=None,
                        help="also build each variant's prebuilt library (variants/libkivi_cuda_decode_<variant>.so) "
                             "into this .tar.xz, for the GPU suite's variants stage (xz: ~0.2-0.8 MB a library instead "
                             "of 2-5 MB, so they travel within the call's 64 MiB; ~2-3 minutes a library on 2 cores)")
    args = parser.parse_args(argv)
    result = measure(args.arch)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    if args.md:
        Path(args.md).write_text(markdown(result))
    if args.libraries:
        import tarfile

        from kivi_ops.kernels.cuda.prebuilt import build

        with tempfile.TemporaryDirectory() as tmp, tarfile.open(args.libraries, "w:xz") as tar:
            for name in GPU_VARIANTS:
                defines = VARIANTS[name]
                lib = build(Path(tmp) / f"libkivi_cuda_decode_{name}.so", args.arch, defines)
                tar.add(lib, arcname=f"variants/{lib.name}")
                print(f"built {lib.name}", flush=True)
        print(f"wrote {args.libraries}")
