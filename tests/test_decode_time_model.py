"""The decode-attention time model (lab/decode_time_model.py) against the committed H200
measurements: its arithmetic, its launch structure, and that every measured point stays within
the 25% band (no GPU; the static facts are the committed sm_90 counts)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lab.decode_time_designs import predictions
from lab.decode_time_model import (
    BAND, CALIBRATION_JSON, FIT_SET, MEASURED_JSON, PREDICTIONS_JSON, STATIC_JSON, Loop, Params, calibrate,
    cuda_cpp_launches, error_table, launches_of, load, makespan_us, predict_us, program_us,
    triton_decode_launches,
)

ROOT = Path(__file__).resolve().parent.parent  # `import lab` from the repository root

# Points the model cannot bring within the band, with what it lacks (docs/performance.md, "Static
# model, calibrated on two H200 runs"). The test fails if one of them comes back into the band, or
# another one leaves it.
# - Triton's 1 warp x 32 default at 32K and on the long context curve (+27% to +54%): its counted SASS
#   (Triton 3.8 here, ptxas spilling 1112 B per thread) is not what the GPU ran (Triton 3.6 with the
#   image's ptxas, 248-250 B); the two runs also differ by 17-20% between shas with the same loop counts.
# - Triton 4 warps x 16 at GQA 1K (+28%) and the CUDA C++ default at GQA 32K (-25%): one warp CPI for
#   every kernel; the model has no per-kernel instruction-level parallelism.
KNOWN_OUT = {
    ("sweep 2026-11-26", "triton_decode", 32, 8, 1024, 4, 16, None),
    ("sweep 2026-11-26", "triton_decode", 32, 8, 32768, 1, 32, None),
    ("sweep 2026-11-27", "triton_decode", 32, 32, 32768, 1, 32, None),
    ("sweep 2026-11-27", "triton_decode", 32, 8, 32768, 1, 32, None),
    ("sweep 2026-11-27", "cuda_cpp", 32, 8, 32768, None, None, None),
    ("bench_attention 2026-11-26", "triton_decode", 32, 32, 131072, 1, 32, None),
    ("bench_attention 2026-11-27", "triton_decode", 32, 32, 8192, 1, 32, None),
    ("bench_attention 2026-11-27", "triton_decode", 32, 32, 16384, 1, 32, None),
    ("bench_attention 2026-11-27", "triton_decode", 32, 32, 65536, 1, 32, None),
    ("bench_attention 2026-11-27", "triton_decode", 32, 32, 131072, 1, 32, None),
}


@pytest.fixture(scope="module")
def static():
    return load(STATIC_JSON)


@pytest.fixture(scope="module")
def committed():
    return load(CALIBRATION_JSON)


def test_makespan_is_the_greedy_schedule():
    assert makespan_us([], 4) == 0.0
    assert makespan_us([3.0, 1.0], 4) == 3.0  # one wave: the longest program
    # 2 slots: 2, 2 start; 1 takes a slot freed at t=2 and ends at 3; the last takes the other (2 -> 4)
    assert makespan_us([2.0, 2.0, 1.0, 2.0], 2) == 4.0
    assert makespan_us([2.0, 2.0, 1.0, 2.0, 1.0], 2) == 4.0  # ... and the fifth the first (3 -> 4)


def test_program_time_is_round_trips_plus_issue():
    loop = Loop(instructions=1000, sm_cycles=500.0)  # pipe-bound at 0.5 SM cycles per instruction
    params = Params(latency_us=1.0, warp_cpi=2.0, launch_us=0.0, read_tb_s=1.0)
    phases = [(2, None, 0), (1, loop, 3)]
    # alone-ish (4 warps share the pipe: 4 x 0.5 = 2 = the warp's own CPI): 2 + 3 x (1 + 1000 x 2 / 1980)
    assert program_us(phases, params, 4) == pytest.approx(2 + 3 * (1 + 2000 / 1980))
    # 16 warps on the SM: each gets 16 x 0.5 = 8 cycles per instruction
    assert program_us(phases, params, 16) == pytest.approx(2 + 3 * (1 + 8000 / 1980))


def test_launch_structure_matches_the_kernels_launch_arithmetic(static):
    # batch 8 x 32 query heads: 132 * 16 programs wanted -> 9 splits of the decode kernel, then the reduce
    decode, reduce = triton_decode_launches(static, 8, 32, 32, 32768)
    assert len(decode["programs"]) == 8 * 32 * 9 and len(reduce["programs"]) == 8 * 32
    assert decode["resident"] == 8  # 255 registers x 1 warp
    # CUDA C++: 2 splits for 256 rows, 5 for 64 (two blocks per SM), plus the tail split
    for H, splits in ((32, 2), (8, 5)):
        main, merge = cuda_cpp_launches(static, 8, 32, H, 32768)
        assert len(main["programs"]) == 8 * H * (splits + 1) and len(merge["programs"]) == 8 * 32
    # the residual in the kernel removes the tail split
    main, _ = cuda_cpp_launches(static, 8, 32, 32, 32768, residual_as_chunks=True)
    assert len(main["programs"]) == 8 * 32 * 2


def test_committed_calibration_is_reproduced(static, committed):
    measured = load(MEASURED_JSON)
    params = Params(**committed["params"])
    rows = error_table(measured["points"], static, params)
    assert [r["predicted_us"] for r in rows] == [r["predicted_us"] for r in committed["rows"]]
    refit = calibrate(static, measured)
    for name, value in committed["params"].items():
        assert refit["params"][name] == pytest.approx(value, rel=0.01), name


def test_every_measured_point_is_within_the_band(committed):
    rows = committed["rows"]
    assert {r["source"] for r in rows} == {"sweep 2026-11-26", "sweep 2026-11-27", "bench_attention 2026-11-26",
                                           "bench_attention 2026-11-27"}
    assert committed["fit_set"] == FIT_SET and 0 < sum(r["fitted"] for r in rows) < len(rows) / 2
    assert {r["kernel"] for r in rows} == {"triton_decode", "cuda_cpp", "sdpa"}
    for r in rows:  # the error column is the prediction's, not copied from elsewhere
        assert r["error"] == pytest.approx(r["predicted_us"] / r["us"] - 1, abs=2e-3)  # both rounded to 0.1 us
    out = {(r["source"], r["kernel"], r["q_heads"], r["kv_heads"], r["tokens"], r.get("num_warps"), r.get("block_n"),
            r.get("num_splits")) for r in rows if abs(r["error"]) > BAND}
    assert out == KNOWN_OUT


def test_committed_predictions_are_the_models(static, committed):
    fresh = predictions(static, Params(**committed["params"]))
    saved = load(PREDICTIONS_JSON)
    assert saved["model"] == fresh["model"] and saved["params"] == committed["params"]
    assert [r["predicted_us"] for r in saved["as_is"]] == [r["predicted_us"] for r in fresh["as_is"]]
    assert [r["predicted_us"] for r in saved["designs"]] == [r["predicted_us"] for r in fresh["designs"]]


def test_prefetch_stages_trade_waits_for_occupancy(static, committed):
    params = Params(**committed["params"])
    one, two, four = (predict_us(cuda_cpp_launches(static, 8, 32, 32, 32768, stages=s), params) for s in (1, 2, 4))
    assert two < one  # half a round trip per chunk, still 4 blocks per SM
    # 4 stages: +36 KB of shared memory per block leaves 3 blocks per SM, and the 512 split blocks no
    # longer fit in one wave
    assert cuda_cpp_launches(static, 8, 32, 32, 32768, stages=4)[0]["resident"] == 3 and four > two
    with pytest.raises(ValueError, match="kernel must be one of"):
        launches_of(dict(batch=1, q_heads=1, kv_heads=1, tokens=1, kernel="flash"), static)


def _toolkit_missing() -> bool:
    from kivi_ops.kernels.cuda.toolkit import CudaKernelUnavailable, toolkit_root

    try:
        toolkit_root()
    except CudaKernelUnavailable:
        return True
    return False


@pytest.mark.slow
@pytest.mark.skipif(_toolkit_missing(), reason="needs nvcc (the cuda-build extra or a CUDA toolkit)")
def test_static_facts_are_what_the_compilers_give(static):
    # Recompiles every configuration for sm_90 (minutes): the committed counts are the current code's.
    # A fresh process without TRITON_INTERPRET (interpreted kernels are never compiled).
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = "import json; from lab.decode_time_static import collect; print(json.dumps(collect()))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=900, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    fresh = json.loads(out.stdout.strip().splitlines()[-1])
    assert fresh["meta"]["triton"] == static["meta"]["triton"]  # the pinned Triton
    assert fresh["triton_decode"] == static["triton_decode"]
    # The C++ facts describe the source they were compiled from (its digest in the meta: the kernel at
    # 6b03624, since changed: paged, bf16, 4-bit, head_dim 256, GQA up to 16), and another nvcc may
    # schedule the .cu differently. Compare them only when both are the committed ones.
    same_source = fresh["meta"]["cuda_sources_sha256"] == static["meta"]["cuda_sources_sha256"]
    if fresh["meta"]["nvcc"] == static["meta"]["nvcc"] and same_source:
        assert {k: v for k, v in fresh["cuda_cpp"].items() if k != "kernel"} == {
            k: v for k, v in static["cuda_cpp"].items() if k != "kernel"}
