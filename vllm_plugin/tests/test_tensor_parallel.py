"""vLLM's own --tensor-parallel-size with the KIVI cache: each worker holds its share of the KV heads
(KIVI is per head: keys per channel, values per token of one head), its own window pools and
block pages. TP = 2 on this 2-core CPU (one core per worker, gloo) equals TP = 1 token for token."""

import json
import os
import subprocess
import sys

HERE = os.path.dirname(__file__)


def _run(model, tp):
    env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND="0|1" if tp == 2 else "auto", PYTHONPATH=HERE)
    run = subprocess.run([sys.executable, os.path.join(HERE, "tensor_parallel_run.py"), model, str(tp)], env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    (line,) = [line for line in run.stdout.splitlines() if line.startswith("OUTPUTS ")]
    return json.loads(line.split(" ", 1)[1]), run.stdout + run.stderr


def test_tensor_parallel_2_equals_1(tiny_llama):
    one, _ = _run(tiny_llama, 1)
    two, log = _run(tiny_llama, 2)
    # Both workers built KIVI pages and windows (each logs its window pools: 2 layers x 1 of the 2 KV heads).
    for rank in (0, 1):
        assert any(f"Worker_TP{rank}" in line and "hold the full-precision windows" in line
                   for line in log.splitlines()), rank
    assert two == one
