"""Static issue model of the decode attention kernels for sm_90, without a GPU.

The H100 decode kernel ran at 25% of copy bandwidth, issue-latency bound (docs/performance.md):
its bytes are few, its instructions many. This counts them. Each kernel is compiled for sm_90
(ptxas_usage.compile_instead_of_launch; nothing runs), its cubin disassembled with Triton's
nvdisasm, and the steady-state loop (the first backward branch's body: the loop over fully
quantized tiles) is counted by opcode. Per token of one kv head (all its query heads):

- warp instructions issued, and SM cycles at the best case: max(issue at 4 per cycle, the
  busiest pipe at its sm_90 rate per SM per cycle, CUDA programming guide table: FP32 4, integer
  /logic/compare/min-max 2, conversions and MUFU 0.5, LSU and shuffles 1, HMMA.16816 0.25);
- the cycles the token's bytes take at copy bandwidth (bytes / (bandwidth / SMs / clock));
- so the bandwidth share the loop can reach at most with perfect latency hiding. This is a
  ceiling, not a prediction: latency, occupancy and the loop's prologue are not in it.

    .venv/bin/python -m lab issue_model [--json out.json]
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import subprocess
import tempfile
from pathlib import Path

import torch

from kivi_benchmarks.environment import environment

from .ptxas_usage import compile_instead_of_launch, layer_of, ptxas_report

# H100 SXM: 132 SMs at 1.98 GHz; 3.0 TB/s is the device-to-device copy bandwidth (read + write)
# measured in the committed H100 attention run (bench_attention_cuda.json), the bandwidth share's base.
H100 = dict(sms=132, clock_hz=1.98e9, copy_bytes_per_s=3.0e12)
# Warp instructions per SM per cycle by pipe (sm_90). Opcodes not listed count as integer/logic.
PIPE_RATE = dict(fp32=4.0, int=2.0, xu=0.5, lsu=1.0, shfl=1.0, tensor=0.25)
PIPES = {
    "fp32": ("FFMA", "FMUL", "FADD", "HFMA2", "HADD2", "HMUL2", "FSWZADD"),
    "xu": ("I2F", "F2F", "F2I", "MUFU", "FRND"),
    "lsu": ("LDG", "STG", "LDS", "STS", "LDSM", "STSM", "LDGSTS", "LD", "ST", "ATOM", "RED"),
    "shfl": ("SHFL",),
    "tensor": ("HMMA", "HGMMA", "IMMA"),
}


def pipe_of(opcode: str) -> str:
    base = opcode.split(".")[0]
    for pipe, names in PIPES.items():
        if base in names:
            return pipe
    return "int"


def sass_of(kernel, arch: int) -> str:
    import triton

    bin_dir = Path(triton.backends.nvidia.__path__[0]) / "bin"
    with tempfile.TemporaryDirectory() as tmp:
        ptx, cubin = Path(tmp) / "k.ptx", Path(tmp) / "k.cubin"
        ptx.write_text(kernel.asm["ptx"])
        subprocess.run([str(bin_dir / "ptxas"), f"--gpu-name=sm_{arch}a", str(ptx), "-o", str(cubin)], check=True)
        return subprocess.run([str(bin_dir / "nvdisasm"), "-c", str(cubin)], capture_output=True, text=True,
                              check=True).stdout


def sass_loops(lines) -> list[list[str]]:
    """Opcodes of the body of every loop (label .. a backward branch to it), in the order their
    branches appear; lines: the SASS's lines (nvdisasm -c)."""
    ops, labels, loops = [], {}, []
    for line in lines:
        label = re.match(r"\s*(\.L_x_\d+):", line)
        if label:
            labels[label.group(1)] = len(ops)
            continue
        ins = re.match(r"\s*/\*[0-9a-f]+\*/\s+(.*?)\s*;", line)
        if not ins:
            continue
        text = re.sub(r"^@!?U?P\w+\s+", "", ins.group(1))
        ops.append(text.split()[0])
        target = re.search(r"(\.L_x_\d+)", text)
        if ops[-1].startswith("BRA") and target and labels.get(target.group(1), len(ops)) < len(ops) - 1:
            loops.append(ops[labels[target.group(1)]:])
    return loops


def first_loop(sass: str) -> list[str]:
    """Opcodes of the body of the first loop (label .. its backward branch)."""
    loops = sass_loops(sass.splitlines())
    if not loops:
        raise ValueError("no loop found in the SASS")
    return loops[0]


def token_bytes(head_dim: int, bits: int, group: int, scale_bytes: int = 2) -> float:
    """Bytes of one quantized token of one kv head: key and value codes, the value scale/zero per
    group of min(G, D) channels, and the key scale/zero rows amortized over G tokens."""
    codes = 2 * head_dim * bits / 8
    value_groups = head_dim // min(group, head_dim)
    return codes + value_groups * 2 * scale_bytes + head_dim * 2 * scale_bytes / group


def model_row(kernel, arch: int, tokens_per_iter: int, programs_per_kv_head: int, bytes_per_token: float) -> dict:
    loop = first_loop(sass_of(kernel, arch))
    warps = kernel.metadata.num_warps
    scale = warps * programs_per_kv_head / tokens_per_iter  # warp instructions per token of a kv head
    by_pipe = collections.Counter(pipe_of(op) for op in loop)
    per_token = {pipe: n * scale for pipe, n in by_pipe.items()}
    issue_cycles = sum(per_token.values()) / 4
    pipe_cycles = {pipe: n / PIPE_RATE[pipe] for pipe, n in per_token.items()}
    bound = max(pipe_cycles, key=pipe_cycles.get)
    cycles = max(issue_cycles, pipe_cycles[bound])
    byte_cycles = bytes_per_token / (H100["copy_bytes_per_s"] / H100["sms"] / H100["clock_hz"])
    report = ptxas_report(kernel.asm["ptx"], arch)
    return dict(warp_instructions_per_token=round(sum(per_token.values()), 1),
                by_pipe={p: round(n, 1) for p, n in sorted(per_token.items())},
                sm_cycles_per_token=round(cycles, 2), bound="issue" if issue_cycles >= pipe_cycles[bound] else bound,
                byte_cycles_per_token=round(byte_cycles, 2), bandwidth_share_ceiling=round(min(1.0, byte_cycles / cycles), 3),
                loop_instructions=len(loop), warps=warps, registers=report["registers"],
                spill_bytes=report["spill_store_bytes"], shared_bytes=kernel.metadata.shared)


def cases():
    """(label, launch, tokens per loop iteration, programs per kv head) at the benchmark shapes."""
    from kivi_ops.kernels.triton.decode import attend_decode
    from lab.triton_decode_mma import attend_decode_mma
    from kivi_ops.kernels.triton.split import attend_launch_config, attend_split

    for q_heads, kv_heads in ((32, 32), (32, 8)):
        qg = q_heads // kv_heads
        t, p = layer_of(kv_heads=kv_heads, head_dim=128, bits=2, tokens=32768 + 256)
        q = torch.randn(1, q_heads, 1, 128, dtype=torch.float16)
        shape = f"Hq={q_heads} Hkv={kv_heads} D=128 KIVI-2 fp16"
        for warps, block_n in ((1, 32), (4, 16), (8, 32)):
            yield (f"decode w{warps} n{block_n}", shape, lambda w=warps, n=block_n, t=t, p=p, q=q: attend_decode(
                q, t, None, p, 0.088, num_splits=8, num_warps=w, block_n=n), block_n, qg)
        split_n = attend_launch_config(128, True, qg)[1]
        yield ("split (q_len 1)", shape, lambda t=t, p=p, q=q: attend_split(q, t, None, p, 0.088, num_splits=8),
               split_n, 1)
        for warps in (2, 4, 8):
            for magic in (True, False):
                yield (f"mma w{warps} {'magic' if magic else 'cvt'}", shape,
                       lambda w=warps, m=magic, t=t, p=p, q=q: attend_decode_mma(
                           q, t, None, p, 0.088, num_splits=8, num_warps=w, magic=m), 32, 1)


def measure(arch: int = 90) -> list[dict]:
    rows = []
    for label, shape, launch, tokens, programs in cases():
        with compile_instead_of_launch(arch) as compiled:
            launch()
        kernel = compiled[0][1]
        rows.append(dict(kernel=label, shape=shape, **model_row(kernel, arch, tokens, programs, token_bytes(128, 2, 32))))
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m lab issue_model", description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", type=int, default=90)
    parser.add_argument("--json", default=None, help="write the rows here")
    args = parser.parse_args(argv)
    rows = measure(args.arch)
    print(f"{'shape':<34} {'kernel':<16} {'instr/token':>11} {'cycles':>7} {'bound':>6} {'bytes cyc':>9} "
          f"{'bw ceiling':>10} {'regs':>5} {'spill':>6}")
    for r in rows:
        print(f"{r['shape']:<34} {r['kernel']:<16} {r['warp_instructions_per_token']:>11} "
              f"{r['sm_cycles_per_token']:>7} {r['bound']:>6} {r['byte_cycles_per_token']:>9} "
              f"{r['bandwidth_share_ceiling']:>10.0%} {r['registers']:>5} {r['spill_bytes']:>6}")
    if args.json:
        meta = dict(arch=f"sm_{args.arch}a", **environment(command=f"python -m lab issue_model --arch {args.arch}"),
                    device_model=H100, pipe_rates=PIPE_RATE,
                    note="static: the steady-state loop's SASS counted per token of one kv head; a ceiling "
                         "on the bandwidth share with perfect latency hiding, not a timing")
        Path(args.json).write_text(json.dumps(dict(meta=meta, rows=rows), indent=1) + "\n")
