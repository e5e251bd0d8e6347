"""What cold compile caches cost the fast suite, per test file (issue 43, item 1).

`make test` on a fresh machine starts with empty Inductor and Triton on-disk caches, and every
compiled graph (torch.compile's C++/Triton codegen) is built from scratch; a developer's machine
has them warm. For each test file this runs the fast tests (`-m "not slow"`) alone in one
process twice against the same fresh cache directories: first cold (empty), then warm (filled by
the first run). Their difference is what cold compiles cost that file.

    .venv/bin/python -m lab.test_compile_costs                   # every tests/test_*.py
    .venv/bin/python -m lab.test_compile_costs tests/test_model.py tests/test_export.py
    .venv/bin/python -m lab.test_compile_costs --out costs.tsv   # also append rows as they finish
    .venv/bin/python -m lab.test_compile_costs --logs logs/      # and keep each run's output, with
                                                                 # pytest's per-test durations

Runs under `nice -n 10`. The machine is shared, so wall times swing with its load; the table
also gives CPU seconds (user + system of pytest and the compilers it waits for), which a busy
machine barely changes: compare files and cold against warm by CPU time, and divide the sum by
the two workers of `make test` for an estimate of its wall time on an idle 2-core machine.
"""

import argparse
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parent.parent


def children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_pytest(test_file: Path, cache_root: Path, log: Optional[Path]) -> tuple[float, float, str]:
    """One single-process pytest run of a file's fast tests with the caches under cache_root;
    its output (with every test's duration over a second) goes to `log` when given."""
    env = dict(os.environ,
               TORCHINDUCTOR_CACHE_DIR=str(cache_root / "inductor"),
               TRITON_CACHE_DIR=str(cache_root / "triton"))
    command = ["nice", "-n", "10", sys.executable, "-m", "pytest", "-q", "-p", "no:xdist",
               "-m", "not slow", "--durations=0", "--durations-min=1", str(test_file)]
    start, start_cpu = time.perf_counter(), children_cpu_s()
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    wall, cpu = time.perf_counter() - start, children_cpu_s() - start_cpu
    if log:
        log.write_text(done.stdout + done.stderr)
    lines = done.stdout.strip().splitlines()
    # pytest's last line: "12 passed, 1 skipped in 3.21s" (or the error that stopped it).
    return wall, cpu, lines[-1] if lines else done.stderr.strip()[-200:]


def measure(test_file: Path, logs: Optional[Path]) -> tuple[tuple[float, float], tuple[float, float], str]:
    """(wall, cpu) seconds cold, then warm, and pytest's summary line of the cold run."""
    def log(kind: str) -> Optional[Path]:
        return logs / f"{Path(test_file).stem}.{kind}.log" if logs else None

    with tempfile.TemporaryDirectory(prefix="compile-costs-") as cache_root:
        cold_wall, cold_cpu, summary = run_pytest(test_file, Path(cache_root), log("cold"))
        warm_wall, warm_cpu, _ = run_pytest(test_file, Path(cache_root), log("warm"))
    return (cold_wall, cold_cpu), (warm_wall, warm_cpu), summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="*", type=Path,
                        help="test files (default: every tests/test_*.py)")
    parser.add_argument("--out", type=Path, help="append each row to this TSV as it finishes")
    parser.add_argument("--logs", type=Path, help="a folder for each run's output (per-test durations)")
    args = parser.parse_args()
    if args.logs:
        args.logs.mkdir(parents=True, exist_ok=True)
    files = args.files or sorted((ROOT / "tests").glob("test_*.py"))
    header = "file\tcold_cpu_s\twarm_cpu_s\tcompile_share\tcold_wall_s\twarm_wall_s\tresult"
    print(header, flush=True)
    if args.out and not args.out.exists():
        args.out.write_text(header + "\n")
    total_cold = total_warm = 0.0
    for test_file in files:
        (cold_wall, cold), (warm_wall, warm), summary = measure(test_file, args.logs)
        total_cold += cold
        total_warm += warm
        share = (cold - warm) / cold if cold > 0 else 0.0
        row = (f"{Path(test_file).name}\t{cold:.1f}\t{warm:.1f}\t{share:.0%}\t{cold_wall:.1f}\t{warm_wall:.1f}"
               f"\t{summary}")
        print(row, flush=True)
        if args.out:
            with args.out.open("a") as out:
                out.write(row + "\n")
    print(f"TOTAL CPU\t{total_cold:.1f}\t{total_warm:.1f}\t"
          f"{(total_cold - total_warm) / max(total_cold, 1e-9):.0%}\t"
          f"two workers, idle machine: about {total_cold / 2 / 60:.1f} min cold, {total_warm / 2 / 60:.1f} warm")


if __name__ == "__main__":
    main()
