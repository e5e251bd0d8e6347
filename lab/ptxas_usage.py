"""ptxas resource usage of the Triton kernels for a GPU architecture, without a GPU.

Triton compiles a kernel when it is launched; here every launch of the cache's Triton paths is
intercepted and compiled for the chosen target (default sm_90, the H100) instead of run, and
ptxas (bundled with Triton) reports registers, spills and shared memory for the PTX. Occupancy
follows from those and the architecture's limits. Nothing runs on a device, so the inputs are
CPU tensors of the benchmark shapes (only their shapes, dtypes and strides matter).

    .venv/bin/python -m lab ptxas_usage [--arch 90] [--json out.json]

Shapes: the Llama-2-7B decode benchmark (32 KV heads, head_dim 128, fp16, KIVI-2, KIVI-3 and KIVI-4,
G=32, R=128, 32K tokens), a GQA head_dim-64 variant and Gemma 3 270M's head_dim 256 (4 query heads
on 1 KV head); the decode kernel is also swept over
num_warps and BLOCK_N, the two knobs that set its register pressure.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import subprocess
import tempfile
from pathlib import Path

import torch

from kivi_benchmarks.environment import environment

# sm_90 (Hopper) limits per SM, from the CUDA programming guide's compute-capability table.
SM90 = dict(registers=65536, max_warps=64, max_blocks=32, shared_bytes=233472, reg_alloc_unit=256)


def occupancy(regs: int, num_warps: int, shared: int, limits: dict = SM90) -> float:
    """Resident warps / the SM's maximum, from registers (allocated per warp in units of 256),
    warps and shared memory per block."""
    per_warp = -(-regs * 32 // limits["reg_alloc_unit"]) * limits["reg_alloc_unit"]
    by_regs = limits["registers"] // (per_warp * num_warps)
    by_warps = limits["max_warps"] // num_warps
    by_shared = limits["shared_bytes"] // shared if shared else limits["max_blocks"]
    blocks = min(by_regs, by_warps, by_shared, limits["max_blocks"])
    return blocks * num_warps / limits["max_warps"]


def ptxas_report(ptx: str, arch: int) -> dict:
    """Registers, spill bytes and stack of the PTX's entry, as `ptxas -v` prints them."""
    import triton

    ptxas = Path(triton.backends.nvidia.__path__[0]) / "bin" / "ptxas"
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(ptx)
        f.flush()
        out = subprocess.run([str(ptxas), "-v", f"--gpu-name=sm_{arch}a", f.name, "-o", "/dev/null"],
                             capture_output=True, text=True, check=True).stderr
    regs = int(re.search(r"Used (\d+) registers", out).group(1))
    stores, loads = map(int, re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", out).groups())
    stack = int(re.search(r"(\d+) bytes stack frame", out).group(1))
    return dict(registers=regs, spill_store_bytes=stores, spill_load_bytes=loads, stack_bytes=stack)


@contextlib.contextmanager
def compile_instead_of_launch(arch: int):
    """Within: a Triton launch compiles for sm_{arch} and records the kernel; nothing runs."""
    from triton.backends.compiler import GPUTarget
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction

    class CompileOnlyDriver:  # what JITFunction.run(warmup=True) asks of the active driver
        def get_current_device(self):
            return 0

        def get_current_stream(self, device=None):
            return 0

        def get_current_target(self):
            return GPUTarget("cuda", arch, 32)

        def get_active_torch_device(self):
            return torch.device("cpu")

        def is_active(self):
            return True

    compiled = []

    def getitem(self, grid):
        def launch(*args, **kwargs):
            compiled.append((self.fn.__name__, self.run(*args, grid=grid, warmup=True, **kwargs)))
        return launch

    saved = JITFunction.__getitem__, torch.library.wrap_triton
    previous_driver = driver._active  # None until first used; reading .active without a GPU raises
    JITFunction.__getitem__, torch.library.wrap_triton = getitem, (lambda fn: fn)
    driver.set_active(CompileOnlyDriver())
    try:
        yield compiled
    finally:
        JITFunction.__getitem__, torch.library.wrap_triton = saved
        driver._active = previous_driver


def layer_of(*, kv_heads: int, head_dim: int, bits: int, tokens: int, batch: int = 1, sparse_outliers: float = 0.0,
             sink_tokens: int = 0, outlier_tokens: int = 0):
    from kivi_ops import KIVICache, KIVIConfig

    config = KIVIConfig(k_bits=bits, v_bits=bits, group_size=32, residual_length=128, sparse_outliers=sparse_outliers,
                        sink_tokens=sink_tokens, outlier_tokens=outlier_tokens, outlier_skip_layers=0)
    cache = KIVICache(config, num_layers=1,
                      batch_size=batch, max_seq_len=tokens, num_kv_heads=kv_heads, head_dim=head_dim,
                      dtype=torch.float16, device="cpu")
    layer = cache.layers[0]
    return layer.tensors(), layer.params


def cases(bits_list=(2, 3, 4)):
    """(label, function launching the kernels, knobs) at the benchmark shapes, per bit width
    (KIVI-3: 8 codes per 3 bytes, packing.py)."""
    from kivi_ops.kernels.triton.append import append_triton
    from kivi_ops.kernels.triton.decode import attend_decode
    from kivi_ops.kernels.triton.split import attend_split

    for kv_heads, q_heads, head_dim in ((32, 32, 128), (8, 32, 64), (1, 4, 256)):  # the last: Gemma 3 270M
        for bits in bits_list:
            shape = f"Hq={q_heads} Hkv={kv_heads} D={head_dim} KIVI-{bits}"
            t, p = layer_of(kv_heads=kv_heads, head_dim=head_dim, bits=bits, tokens=32768 + 256)
            q1 = torch.randn(1, q_heads, 1, head_dim, dtype=torch.float16)
            for warps in (1, 2, 4, 8):
                for block_n in (16, 32):
                    yield (f"decode {shape}", dict(num_warps=warps, block_n=block_n),
                           lambda t=t, p=p, q1=q1, w=warps, n=block_n: attend_decode(
                               q1, t, None, p, 0.088, num_splits=8, num_warps=w, block_n=n))
            yield (f"split q_len=1 {shape}", {}, lambda t=t, p=p, q1=q1: attend_split(q1, t, None, p, 0.088, num_splits=8))
            q16 = torch.randn(1, q_heads, 16, head_dim, dtype=torch.float16)
            yield (f"split q_len=16 {shape}", {}, lambda t=t, p=p, q16=q16: attend_split(q16, t, None, p, 0.088))
            ts, ps = layer_of(kv_heads=kv_heads, head_dim=head_dim, bits=bits, tokens=32768 + 256,
                              sparse_outliers=0.01)
            yield (f"decode {shape} sparse 1%", {}, lambda t=ts, p=ps, q1=q1: attend_decode(
                q1, t, None, p, 0.088, num_splits=8))
            yield (f"split q_len=16 {shape} sparse 1%", {}, lambda t=ts, p=ps, q16=q16: attend_split(
                q16, t, None, p, 0.088))
            tp, pp = layer_of(kv_heads=kv_heads, head_dim=head_dim, bits=bits, tokens=32768 + 256, sink_tokens=1,
                              outlier_tokens=8)
            for n in (1, 16):  # a decode step (one launch), a prefill chunk
                kv = torch.randn(1, kv_heads, n, head_dim, dtype=torch.float16)
                for option, (t_, p_) in (("", (t, p)), (" sparse 1%", (ts, ps)), (" sink 1 + OTT 8", (tp, pp))):
                    yield (f"append {n} token{'s' if n > 1 else ''} {shape}{option}", {},
                           lambda t=t_, p=p_, kv=kv: append_triton(t, kv, kv, None, p))


def measure(arch: int, cases=cases, bits_list=None) -> list[dict]:
    rows = []
    for label, knobs, launch in (cases() if bits_list is None else cases(bits_list)):
        with compile_instead_of_launch(arch) as compiled:
            launch()
        for name, kernel in compiled:
            if name == "_attend_reduce_kernel" and any(r["kernel"] == name and r["case"] == label for r in rows):
                continue  # the same reduce kernel behind every decode variant of a shape
            report = ptxas_report(kernel.asm["ptx"], arch)
            warps, shared = kernel.metadata.num_warps, kernel.metadata.shared
            rows.append(dict(case=label, kernel=name, **knobs, launch_num_warps=warps, shared_bytes=shared, **report,
                             occupancy=occupancy(report["registers"], warps, shared)))
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m lab ptxas_usage", description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", type=int, default=90, help="compute capability x 10 (90: H100/H200)")
    parser.add_argument("--json", default=None, help="write the rows here")
    parser.add_argument("--bits", default="2,3,4", help="KIVI bit widths, comma-separated (default 2,3,4)")
    args = parser.parse_args(argv)
    rows = measure(args.arch, bits_list=tuple(int(b) for b in args.bits.split(",")))
    print(f"{'case':<40} {'kernel':<24} {'knobs':<22} {'warps':>5} {'regs':>5} {'spill st/ld':>12} {'smem':>7} {'occ':>5}")
    for r in rows:
        knobs = f"w={r['num_warps']} n={r['block_n']}" if "num_warps" in r else ""
        print(f"{r['case']:<40} {r['kernel']:<24} {knobs:<22} {r['launch_num_warps']:>5} {r['registers']:>5} "
              f"{r['spill_store_bytes']:>5}/{r['spill_load_bytes']:<6} {r['shared_bytes']:>7} {r['occupancy']:>5.2f}")
    if args.json:
        meta = dict(arch=f"sm_{args.arch}a",
                    **environment(command=f"python -m lab ptxas_usage --arch {args.arch} --bits {args.bits}"),
                    note="compiled without a GPU (Triton's ptxas on the generated PTX); occupancy from sm_90 limits")
        Path(args.json).write_text(json.dumps(dict(meta=meta, rows=rows), indent=1) + "\n")
