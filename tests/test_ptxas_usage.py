"""The ptxas resource report (lab/ptxas_usage.py) compiles kernels for sm_90 with no GPU."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lab.ptxas_usage import SM90, occupancy

ROOT = Path(__file__).resolve().parent.parent  # `import lab` from the repository root


def test_occupancy_follows_the_sm90_limits():
    assert occupancy(32, 4, 0) == 1.0  # 64 warps resident: the SM's maximum
    assert occupancy(255, 1, 0) == 8 / 64  # 255 regs -> 8192 per warp -> 8 one-warp blocks
    assert occupancy(64, 8, SM90["shared_bytes"] // 2) == 2 * 8 / 64  # shared memory allows 2 blocks


DECODE_CASE = """
import json, torch
from lab.ptxas_usage import layer_of, measure
from kivi_ops.kernels.triton.decode import attend_decode
t, p = layer_of(kv_heads=2, head_dim=64, bits=BITS, tokens=256)
q = torch.randn(1, 4, 1, 64, dtype=torch.float16)
case = lambda: iter([("decode", {}, lambda: attend_decode(q, t, None, p, 0.125, num_splits=2, num_warps=4, block_n=16))])
print(json.dumps(measure(90, case)))
"""


@pytest.mark.parametrize("bits", [2, 3])  # 3: 8 codes per 3 bytes, read as three byte planes
def test_decode_kernel_compiles_for_sm90_without_a_gpu(bits):
    # A fresh process without TRITON_INTERPRET (the suite's conftest sets it, and interpreted
    # kernels are never compiled).
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", f"BITS = {bits}\n" + DECODE_CASE], capture_output=True, text=True,
                         env=env, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = json.loads(out.stdout.strip().splitlines()[-1])
    kernels = {r["kernel"]: r for r in rows}
    assert set(kernels) == {"_attend_decode_kernel", "_attend_reduce_kernel"}
    decode = kernels["_attend_decode_kernel"]
    assert 0 < decode["registers"] <= 255 and decode["launch_num_warps"] == 4
    assert decode["spill_store_bytes"] >= 0 and 0 < decode["occupancy"] <= 1


WIDE_HEAD_CASE = """
import json, torch
from lab.ptxas_usage import layer_of, measure
from kivi_ops.kernels.triton.decode import attend_decode
rows = []
for bits in (2, 4):
    t, p = layer_of(kv_heads=1, head_dim=256, bits=bits, tokens=512)
    q = torch.randn(1, 4, 1, 256, dtype=torch.float16)
    case = lambda: iter([("decode", {}, lambda: attend_decode(q, t, None, p, 0.0625, num_splits=2))])
    rows += measure(90, case)
print(json.dumps(rows))
"""


@pytest.mark.slow  # ptxas at head_dim 256, about 10 s; the head_dim 128 builds above run in `make test`
def test_decode_kernel_default_at_head_dim_256_does_not_spill():
    # Gemma's head_dim: the default launch (triton_decode.decode_launch_config) must compile to
    # no spills for KIVI-2 and KIVI-4 (the 1 warp x 32 tokens default of narrower heads spills
    # 9.5-14 KB per thread there).
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", WIDE_HEAD_CASE], capture_output=True, text=True, env=env,
                         timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [r for r in json.loads(out.stdout.strip().splitlines()[-1]) if r["kernel"] == "_attend_decode_kernel"]
    assert len(rows) == 2
    for r in rows:
        assert r["launch_num_warps"] == 4 and r["spill_store_bytes"] == 0 and r["registers"] <= 255, r
