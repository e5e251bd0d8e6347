"""Static time model of the decode-attention kernels on the H200, calibrated on two measured runs.

issue_model.py gives each kernel's steady-state loop a ceiling (instructions per token against
bytes per token). This turns the same static facts into a time per launch, so that a design can
be priced before a GPU runs it:

- What the compiler says (static, `--static`; needs Triton's ptxas/nvdisasm and the cuda-build
  nvcc): registers per kernel configuration, hence programs resident per SM (ptxas_usage.occupancy),
  and the warp instructions of each loop body and the SM cycles its busiest pipe needs
  (issue_model's pipe rates), for the Triton decode kernel's quantized and mixed (residual) tiles
  and the CUDA C++ kernel's 32-token chunk and tail token.
- What the launch does (from the kernels' own launch arithmetic): the grid, the tiles or chunks
  each program walks, the programs' order; programs are list-scheduled onto 132 SMs x the resident
  slots, so waves and tails (one long split, a residual split) come out of the schedule.
- Four parameters with a physical meaning, fitted on a subset of the measured points
  (`FIT_SET`) and checked on the rest:
    latency_us   one dependent round trip to memory (each program's prologue takes two: the length
                 and the query; each tile or chunk iteration one: its loads are issued together,
                 its arithmetic waits for them), so bytes in flight per SM = resident warps x the
                 bytes of one iteration;
    warp_cpi     cycles per instruction of one warp running alone (dependent chains); a warp
                 never issues faster than the SM's busiest pipe allows it when the SM's resident
                 warps share that pipe;
    launch_us    per kernel launch inside a CUDA graph (ramp, drain, the gap to the next);
    read_tb_s    DRAM read bandwidth: no launch is faster than its distinct bytes / this (SDPA,
                 which reads fp16 at the bandwidth, anchors it).

A program's time = sum over its phases of round trips x latency + instructions x
max(warp_cpi, resident warps x pipe cycles per instruction) / clock. A launch's time =
launch_us + max(the schedule's makespan, distinct bytes / read bandwidth).

    .venv/bin/python -m lab decode_time_model [--static] [--calibration out.json] [--predictions out.json]
"""

from __future__ import annotations

import argparse
import collections
import heapq
import json
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "h200"
STATIC_JSON = RESULTS / "decode_kernels_sm90_static.json"
MEASURED_JSON = RESULTS / "decode_attention_measured.json"
CALIBRATION_JSON = RESULTS / "decode_time_model_calibration.json"
PREDICTIONS_JSON = RESULTS / "predictions_decode_time_model.json"
MODEL_VERSION = "decode_time_model v1 (2026-11-28)"

# H200 SXM: 132 SMs, 1.98 GHz boost (the clock the graph replays run at; the same SM as the H100 SXM).
DEVICE = dict(name="NVIDIA H200", sms=132, clock_hz=1.98e9)
BAND = 0.25  # a point predicted further than this from its measurement is out of the band
# The fit set: the 2026-11-26 sweep (four Triton launch configurations and SDPA, MHA and GQA, 1K and
# 32K) and the CUDA C++ kernel at its default split count (2026-11-27). Everything else only checks:
# the CUDA C++ kernel at 1 and 16 splits (the schedule: one long split, 9 waves), the Triton default
# at the 2026-11-27 sha, and both runs' context curves (2K-128K).
FIT_SET = "sweep 2026-11-26 + CUDA C++ default splits"


def in_fit_set(point: dict) -> bool:
    return point["source"] == "sweep 2026-11-26" or (
        point["source"] == "sweep 2026-11-27" and point["kernel"] == "cuda_cpp" and point.get("num_splits") is None)

# Kernel launch arithmetic (kivi_ops/kernels/triton/attend.py, decode.py, kivi_ops/kernels/cuda/attend.py)
TRITON_PROGRAMS_PER_SM = 16  # triton_decode.DECODE_PROGRAMS_PER_SM
TRITON_MAX_SPLITS = 64
CUDA_MAX_SPLITS, CUDA_SPLIT_MIN_TOKENS, CUDA_WARPS, CUDA_CHUNK = 64, 128, 4, 32
PROLOGUE_ROUND_TRIPS = 2  # the row's length, then the query (and the scales it folds into)
REDUCE_ROUND_TRIPS = 2  # a merge kernel reads the splits' partials, then writes


@dataclass(frozen=True)
class Params:
    latency_us: float
    warp_cpi: float
    launch_us: float
    read_tb_s: float


@dataclass(frozen=True)
class Loop:
    """One loop body of a kernel: warp instructions and the SM cycles its busiest pipe (or issue at
    4 per cycle) needs for them."""
    instructions: int
    sm_cycles: float

    @property
    def pipe_cycles_per_instruction(self) -> float:
        return self.sm_cycles / self.instructions


def loop_of(ops: list[str]) -> Loop:
    """A Loop from a body's SASS opcodes (issue_model.sass_loops)."""
    from .issue_model import PIPE_RATE, pipe_of

    by_pipe = collections.Counter(pipe_of(op) for op in ops)
    cycles = max([len(ops) / 4] + [n / PIPE_RATE[p] for p, n in by_pipe.items()])
    return Loop(len(ops), round(cycles, 2))


# --------------------------------------------------------------------------------------------
# Launch structure: each kernel is a list of launches; a launch is (programs in launch order as
# phase lists, warps per program, programs resident per SM, distinct bytes).
# A phase is (round trips, Loop or None, iterations).

def must_read_bytes(B: int, Hq: int, H: int, L: int, bits: int = 2, D: int = 128, G: int = 32, R: int = 128) -> int:
    from .byte_model import must_read_attend

    return must_read_attend(L, B, Hq, H, D, bits, G, R)


def kivi_counts(L: int, R: int = 128) -> tuple[int, int]:
    """(quantized keys, quantized values) of a row of L tokens under KIVI's flush policy."""
    return L // R * R, max(L - R, 0)


def resident(regs: int, warps: int, shared: int) -> int:
    from .ptxas_usage import SM90, occupancy

    return max(1, round(occupancy(regs, warps, shared) * SM90["max_warps"] / warps))


def reduce_launch(rows: int) -> dict:
    return dict(programs=[[(REDUCE_ROUND_TRIPS, None, 0)]] * rows, warps=4, resident=16, bytes=0)


def triton_decode_launches(static: dict, B: int, Hq: int, H: int, L: int, warps: int = 1, block_n: int = 32,
                           max_seq_len: int | None = None) -> list[dict]:
    cfg = static["triton_decode"][f"{Hq}/{H} w{warps} n{block_n}"]
    S = max_seq_len or L  # the sweeps build caches of exactly `tokens` (gpu_attend_sweep, bench attention)
    target = DEVICE["sms"] * 2 // 2 * TRITON_PROGRAMS_PER_SM
    splits = max(1, min(-(-target // (B * Hq)), -(-S // block_n), TRITON_MAX_SPLITS))
    split_len = -(-(-(-L // splits)) // block_n) * block_n
    nqk, nqv = kivi_counts(L)
    mid_all = min(nqk, nqv) // block_n * block_n
    quant, mixed = Loop(**cfg["quantized_tile"]), Loop(**cfg["mixed_tile"])
    programs = []
    for sp in range(splits):  # grid (B * Hq, splits): the rows of split 0 launch first
        lo, hi = sp * split_len, min(sp * split_len + split_len, L)
        mid = max(min(mid_all, hi), lo)
        n_q, n_m = -(-(mid - lo) // block_n) if mid > lo else 0, -(-(hi - mid) // block_n) if hi > mid else 0
        phases = [(PROLOGUE_ROUND_TRIPS, None, 0), (1, quant, n_q), (1, mixed, n_m)]
        programs += [phases] * (B * Hq)
    res = resident(cfg["registers"], warps, cfg["shared_bytes"])
    launches = [dict(programs=programs, warps=warps, resident=res, bytes=must_read_bytes(B, Hq, H, L))]
    if splits > 1:
        launches.append(reduce_launch(B * Hq))
    return launches


def default_cuda_splits(B: int, H: int, S: int) -> int:
    wanted = -(-2 * DEVICE["sms"] // max(B * H, 1))
    return max(1, min(wanted, S // CUDA_SPLIT_MIN_TOKENS, CUDA_MAX_SPLITS))


def tail_loop(cfg: dict, qg: int) -> Loop:
    """The CUDA C++ tail token's executed instructions for qg query heads: half of the load part
    (each channel runs one side of its quantized / residual if-else), qg of the 8 head blocks, and
    the rest of the body (decode_time_static.cuda_cpp_static)."""
    body, loads, head = (cfg["tail_token"]["instructions"], cfg["tail_loads_instructions"],
                         cfg["tail_per_head_instructions"])
    executed = loads / 2 + qg * head + (body - loads - 8 * head)
    return Loop(round(executed), cfg["tail_token"]["sm_cycles"] * executed / body)


def cuda_cpp_launches(static: dict, B: int, Hq: int, H: int, L: int, num_splits: int | None = None,
                      max_seq_len: int | None = None, stages: int = 1, residual_as_chunks: bool = False,
                      chunk_instructions_saved: int = 0) -> list[dict]:
    """The CUDA C++ kernel as built (defaults) or a design of it: `stages` chunks in flight per warp
    (cp.async multi-stage prefetch: a chunk waits 1 / stages of a round trip, and each stage costs
    4 warps x a chunk's bytes of shared memory); `residual_as_chunks`: the tail's up to R + 31 tokens
    run as fp16 MMA chunks spread over the splits instead of one token per warp in a separate block;
    `chunk_instructions_saved`: warp instructions removed from the chunk loop (e.g. one load for a
    group's scale and zero)."""
    cfg = static["cuda_cpp"]
    splits = num_splits or default_cuda_splits(B, H, max_seq_len or L)
    base = Loop(**cfg["chunk"])
    chunk = Loop(base.instructions - chunk_instructions_saved,
                 base.sm_cycles * (base.instructions - chunk_instructions_saved) / base.instructions)
    tail = tail_loop(cfg, Hq // H)
    nqk, nqv = kivi_counts(L)
    chunks = min(nqk, nqv) // CUDA_CHUNK
    tail_tokens = L - chunks * CUDA_CHUNK
    if residual_as_chunks:
        chunks, tail_tokens = -(-L // CUDA_CHUNK), 0
    per = -(-chunks // splits)
    programs = []
    for sp in range(splits + (1 if tail_tokens else 0)):  # grid (B * H, splits + 1); split `splits` is the tail
        if sp < splits:
            n = max(0, min(per, chunks - sp * per))
            phases = [(PROLOGUE_ROUND_TRIPS, None, 0), (1 / stages, chunk, -(-n // CUDA_WARPS))]
        else:
            phases = [(PROLOGUE_ROUND_TRIPS, None, 0), (1, tail, -(-tail_tokens // CUDA_WARPS))]
        programs += [phases] * (B * H)
    chunk_bytes = CUDA_CHUNK * 96  # KIVI-2 D=128: 64 B of codes + 32 B of scale/zero per token
    res = resident(cfg["registers"], CUDA_WARPS, cfg["shared_bytes"] + (stages - 1) * CUDA_WARPS * chunk_bytes)
    return [dict(programs=programs, warps=CUDA_WARPS, resident=res, bytes=must_read_bytes(B, Hq, H, L)),
            reduce_launch(B * Hq)]


def sdpa_launches(B: int, Hq: int, H: int, L: int, D: int = 128) -> list[dict]:
    """fp16 SDPA (flash decoding): its bytes at the read bandwidth, one launch."""
    return [dict(programs=[], warps=4, resident=1, bytes=B * H * L * D * 2 * 2 + B * Hq * D * 2)]


# --------------------------------------------------------------------------------------------

def program_us(phases, params: Params, warps_per_sm: int) -> float:
    t = 0.0
    for round_trips, loop, iterations in phases:
        t += round_trips * params.latency_us * (iterations if loop is not None else 1)
        if loop is not None and iterations:
            cpi = max(params.warp_cpi, warps_per_sm * loop.pipe_cycles_per_instruction)
            t += iterations * loop.instructions * cpi / DEVICE["clock_hz"] * 1e6
    return t


def makespan_us(durations: list[float], slots: int) -> float:
    """Greedy list schedule in launch order: each program takes the slot that frees first."""
    if not durations:
        return 0.0
    if len(durations) <= slots:
        return max(durations)
    free = [0.0] * slots
    for d in durations:
        heapq.heapreplace(free, free[0] + d)
    return max(free)


def launch_us(launch: dict, params: Params) -> float:
    slots = launch["resident"] * DEVICE["sms"]
    # the warps that share an SM's pipes: its resident programs, fewer when the grid is small
    warps_per_sm = min(launch["resident"], -(-len(launch["programs"]) // DEVICE["sms"])) * launch["warps"]
    cache: dict[int, float] = {}
    durations = []
    for phases in launch["programs"]:
        key = id(phases)
        if key not in cache:
            cache[key] = program_us(phases, params, warps_per_sm)
        durations.append(cache[key])
    bandwidth_us = launch["bytes"] / (params.read_tb_s * 1e12) * 1e6
    return params.launch_us + max(makespan_us(durations, slots), bandwidth_us)


def predict_us(launches: list[dict], params: Params) -> float:
    return sum(launch_us(launch, params) for launch in launches)


def launches_of(point: dict, static: dict) -> list[dict]:
    """The launches of a measured or planned point: kernel "triton_decode" (warps, block_n),
    "cuda_cpp" (num_splits) or "sdpa"."""
    B, Hq, H, L = point["batch"], point["q_heads"], point["kv_heads"], point["tokens"]
    kernel = point["kernel"]
    if kernel == "triton_decode":
        return triton_decode_launches(static, B, Hq, H, L, point["num_warps"], point["block_n"])
    if kernel == "cuda_cpp":
        return cuda_cpp_launches(static, B, Hq, H, L, point.get("num_splits"))
    if kernel == "sdpa":
        return sdpa_launches(B, Hq, H, L)
    raise ValueError(f"kernel must be one of triton_decode, cuda_cpp, sdpa; got {kernel!r}")


# --------------------------------------------------------------------------------------------

def fit(points: list[dict], static: dict, start: Params) -> Params:
    """Least squares on log(predicted / measured) over `points`."""
    import numpy as np
    from scipy.optimize import least_squares

    launches = [launches_of(p, static) for p in points]
    measured = np.array([p["us"] for p in points])

    def residuals(x):
        params = Params(*np.exp(x))
        return np.log([predict_us(ls, params) for ls in launches]) - np.log(measured)

    x0 = np.log([start.latency_us, start.warp_cpi, start.launch_us, start.read_tb_s])
    result = least_squares(residuals, x0, diff_step=1e-3)
    return Params(*(round(float(v), 4) for v in np.exp(result.x)))


def error_table(points: list[dict], static: dict, params: Params) -> list[dict]:
    rows = []
    for p in points:
        pred = predict_us(launches_of(p, static), params)
        rows.append(dict(**p, fitted=in_fit_set(p), predicted_us=round(pred, 1), error=round(pred / p["us"] - 1, 3),
                         in_band=abs(pred / p["us"] - 1) <= BAND))
    return rows


def calibrate(static: dict, measured: dict) -> dict:
    points = measured["points"]
    fit_points = [p for p in points if in_fit_set(p)]
    params = fit(fit_points, static, Params(latency_us=1.0, warp_cpi=4.0, launch_us=3.0, read_tb_s=4.5))
    rows = error_table(points, static, params)
    return dict(model=MODEL_VERSION, fit_set=FIT_SET, band=BAND, params=asdict(params), rows=rows,
                worst_fit=max(abs(r["error"]) for r in rows if r["fitted"]),
                worst_check=max(abs(r["error"]) for r in rows if not r["fitted"]))


def load(path: Path) -> dict:
    return json.loads(Path(path).read_text())


def label(p: dict) -> str:
    if p["kernel"] == "triton_decode":
        return f"triton w{p['num_warps']}x{p['block_n']}"
    if p["kernel"] == "cuda_cpp":
        return f"cuda {p.get('num_splits') or 'default'} splits"
    return p["kernel"]


def print_table(rows: list[dict]) -> None:
    print(f"{'source':<26} {'fit':>3} {'heads':>6} {'tokens':>7} {'kernel':<22} {'measured':>9} {'model':>9} {'error':>7}")
    for r in rows:
        flag = "" if r["in_band"] else "  OUT"
        print(f"{r['source']:<26} {'fit' if r['fitted'] else '':>3} {r['q_heads']:>3}/{r['kv_heads']:<2} {r['tokens']:>7} {label(r):<22} "
              f"{r['us']:>9.1f} {r['predicted_us']:>9.1f} {r['error']:>+7.1%}{flag}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m lab decode_time_model", description=__doc__.split("\n\n")[0])
    parser.add_argument("--static", action="store_true",
                        help=f"recompile the kernels for sm_90 and rewrite {STATIC_JSON.name} (needs the cuda-build "
                             "extra's nvcc and Triton's ptxas; minutes)")
    parser.add_argument("--static-out", default=None,
                        help="with --static: write the recompiled facts here instead of the committed file, and the "
                             "Triton cubins beside it (cubins/): the GPU suite's recount of what the GPU's Triton built")
    parser.add_argument("--static-json", default=None, help="price with these static facts (default: the committed ones)")
    parser.add_argument("--calibration", default=None, help="write the fit and the per-point error table here")
    parser.add_argument("--predictions", default=None, help="write the candidate designs' predicted times here")
    args = parser.parse_args(argv)
    static_json = Path(args.static_json or STATIC_JSON)
    if args.static:
        from .decode_time_static import collect

        out = Path(args.static_out) if args.static_out else STATIC_JSON
        cubins = out.parent / "cubins" if args.static_out else None
        out.write_text(json.dumps(collect(cubins, cuda_cpp_from=STATIC_JSON), indent=1) + "\n")
        static_json = out
    static, measured = load(static_json), load(MEASURED_JSON)
    result = calibrate(static, measured)
    print(f"{MODEL_VERSION}; fitted on {FIT_SET!r}: {result['params']}")
    print_table(result["rows"])
    print(f"worst |error|: fit set {result['worst_fit']:.1%}, check set {result['worst_check']:.1%} (band {BAND:.0%})")
    if args.calibration:
        Path(args.calibration).write_text(json.dumps(result, indent=1) + "\n")
    if args.predictions:
        from .decode_time_designs import predictions

        out = predictions(static, Params(**result["params"]))
        Path(args.predictions).write_text(json.dumps(out, indent=1) + "\n")
