"""The CUDA C++ decode kernel (kivi_ops/kernels/cuda/decode_attend.cu) for sm_90a, without a GPU: ptxas
registers/spills/shared memory per kernel, and the static issue model of issue_model.py applied to
its chunk loop.

nvcc from the `cuda-build` extra compiles the .cu to a cubin (plain nvcc: the kernel file has no
torch header), `-Xptxas -v` reports resources, nvdisasm gives the SASS. The steady-state loop is
the innermost loop whose body holds HMMA: one iteration is one warp's 32-token chunk (a key
group), so warp instructions per token of a kv head are the body's count / 32, whatever the
number of query heads (they share the MMA's N). The tail (the last <= R + 31 tokens of a row, fp32
on CUDA cores) is not in the ceiling: it is a fixed cost per row, ~0.4% of a 32K row.

    .venv/bin/python -m lab cuda_decode_model [--json out.json]
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import subprocess
import tempfile
from pathlib import Path

from kivi_benchmarks.environment import environment
from kivi_ops.kernels.cuda.toolkit import compile_env, tool, toolkit_root

from .issue_model import H100, PIPE_RATE, pipe_of, sass_loops, token_bytes

SOURCE = Path(__file__).resolve().parent.parent / "kivi_ops" / "kernels" / "cuda" / "decode_attend.cu"
NVCC_FLAGS = ("-O3", "-std=c++17", "-Xptxas", "-v")
CHUNK_TOKENS = 32  # tokens per warp iteration of the quantized loop (decode_attend.cu kChunk)


def compile_cubin(arch: str = "sm_90a", source: Path = SOURCE) -> tuple[str, str]:
    """(ptxas -v report, SASS text) of the .cu compiled for arch."""
    root = toolkit_root()
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "k.cubin"
        compute = arch.replace("sm_", "compute_")
        run = subprocess.run([str(tool(root, "nvcc")), f"-gencode=arch={compute},code={arch}", *NVCC_FLAGS, "-cubin",
                              "-o", str(cubin), str(source)], capture_output=True, text=True, env=compile_env(root))
        if run.returncode:
            raise RuntimeError(f"nvcc failed:\n{run.stderr}")
        sass = subprocess.run([str(tool(root, "nvdisasm")), "-c", str(cubin)], capture_output=True, text=True,
                              check=True).stdout
    return run.stderr, sass


def ptxas_resources(report: str) -> dict[str, dict]:
    """Per mangled entry: registers, spill store/load bytes, stack, shared memory (ptxas -v)."""
    rows, name = {}, None
    for line in report.splitlines():
        entry = re.search(r"Compiling entry function '(\w+)'", line)
        if entry:
            name = entry.group(1)
            rows[name] = {}
        elif name and "spill stores" in line:
            rows[name].update(zip(("stack_bytes", "spill_store_bytes", "spill_load_bytes"),
                                  map(int, re.findall(r"(\d+) bytes", line))))
        elif name and "Used" in line and "registers" in line:
            rows[name]["registers"] = int(re.search(r"Used (\d+) registers", line).group(1))
            smem = re.search(r"(\d+) bytes smem", line)
            rows[name]["shared_bytes"] = int(smem.group(1)) if smem else 0
    return rows


def functions(sass: str) -> dict[str, list[str]]:
    """SASS lines per function (nvdisasm's `.text.<name>` sections)."""
    out, name = {}, None
    for line in sass.splitlines():
        section = re.match(r"\s*\.section\s+\.text\.(\w+)", line)
        if section:
            name = section.group(1)
            out[name] = []
        elif name:
            out[name].append(line)
    return out


def mma_loop(lines: list[str]) -> list[str]:
    """Opcodes of the innermost loop (label .. backward branch to it) whose body has an HMMA."""
    loops = sass_loops(lines)
    with_mma = [loop for loop in loops if any(op.startswith("HMMA") for op in loop)]
    if not with_mma:
        raise ValueError("no loop with HMMA found in the SASS")
    return min(with_mma, key=len)


def model_row(loop: list[str], head_dim: int, bits: int = 2, group: int = 32) -> dict:
    """issue_model.model_row's ceiling for a loop of one warp over CHUNK_TOKENS tokens."""
    per_token = {pipe: n / CHUNK_TOKENS for pipe, n in collections.Counter(pipe_of(op) for op in loop).items()}
    issue_cycles = sum(per_token.values()) / 4
    pipe_cycles = {pipe: n / PIPE_RATE[pipe] for pipe, n in per_token.items()}
    bound = max(pipe_cycles, key=pipe_cycles.get)
    cycles = max(issue_cycles, pipe_cycles[bound])
    byte_cycles = token_bytes(head_dim, bits, group) / (H100["copy_bytes_per_s"] / H100["sms"] / H100["clock_hz"])
    return dict(warp_instructions_per_token=round(sum(per_token.values()), 2),
                by_pipe={p: round(n, 2) for p, n in sorted(per_token.items())},
                sm_cycles_per_token=round(cycles, 2), bound="issue" if issue_cycles >= pipe_cycles[bound] else bound,
                byte_cycles_per_token=round(byte_cycles, 2),
                bandwidth_share_ceiling=round(min(1.0, byte_cycles / cycles), 3), loop_instructions=len(loop),
                loop_opcodes=dict(collections.Counter(op.split(".")[0] for op in loop).most_common()))


def measure(arch: str = "sm_90a") -> dict:
    report, sass = compile_cubin(arch)
    resources = ptxas_resources(report)
    bodies = functions(sass)
    rows = []
    for name, res in resources.items():
        row = dict(kernel=name, **res)
        # <D, KB, VB, PAGED, T>: T mangled as 6__half or 13__nv_bfloat16
        variant = re.search(r"decode_split_kernelILi(\d+)ELi(\d)ELi(\d)ELb([01])E\d+__(half|nv_bfloat16)", name)
        if variant:
            head_dim, k_bits, v_bits, paged = map(int, variant.groups()[:4])
            row.update(dtype="bf16" if variant.group(5) == "nv_bfloat16" else "fp16")
            # token_bytes is linear in the bits: mixed widths read the mean width's bytes
            row.update(head_dim=head_dim, k_bits=k_bits, v_bits=v_bits, paged=bool(paged),
                       **model_row(mma_loop(bodies[name]), head_dim, (k_bits + v_bits) / 2))
        rows.append(row)
    return dict(rows=rows, ptxas=report)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m lab cuda_decode_model", description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", default="sm_90a")
    parser.add_argument("--json", default=None, help="write the rows here")
    parser.add_argument("--library", default=None,
                        help="also build the shared library for a GPU machine without nvcc (kivi_ops/kernels/cuda/prebuilt.py) "
                             "here, e.g. .gpu/libkivi_cuda_decode.so")
    args = parser.parse_args(argv)
    if args.library:
        from kivi_ops.kernels.cuda.prebuilt import build

        Path(args.library).parent.mkdir(parents=True, exist_ok=True)
        print(f"built {build(Path(args.library), args.arch)}")
    result = measure(args.arch)
    print(f"{'kernel':<34} {'regs':>5} {'spill st/ld':>11} {'smem':>6} {'instr/token':>11} {'cycles':>7} "
          f"{'bound':>6} {'bytes cyc':>9} {'bw ceiling':>10}")
    for r in result["rows"]:
        short = re.sub(r".*(decode_(split|merge)_kernel).*", r"\1", r["kernel"])
        if "head_dim" in r:
            short += f" {r['head_dim']} k{r['k_bits']}v{r['v_bits']} {r['dtype']}{' paged' if r['paged'] else ''}"
        line = (f"{short:<34} {r['registers']:>5} {r['spill_store_bytes']:>5}/{r['spill_load_bytes']:<5} "
                f"{r['shared_bytes']:>6}")
        if "head_dim" in r:
            line += (f" {r['warp_instructions_per_token']:>11} {r['sm_cycles_per_token']:>7} {r['bound']:>6} "
                     f"{r['byte_cycles_per_token']:>9} {r['bandwidth_share_ceiling']:>10.0%}")
        print(line)
    if args.json:
        from importlib.metadata import version

        meta = dict(arch=args.arch, **environment(command=f"python -m lab cuda_decode_model --arch {args.arch}"),
                    nvcc=version("nvidia-cuda-nvcc"), nvcc_flags=list(NVCC_FLAGS), device_model=H100,
                    pipe_rates=PIPE_RATE, chunk_tokens=CHUNK_TOKENS,
                    note="static: the chunk loop's SASS counted per token of one kv head (per variant: head_dim, "
                         "key/value bits, dtype, paged; G=32, any number of query heads up to 8); a ceiling on the "
                         "bandwidth share with perfect latency hiding, not a timing. Compiled without a GPU.")
        Path(args.json).write_text(json.dumps(dict(meta=meta, **result), indent=1) + "\n")
