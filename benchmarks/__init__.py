"""Quality (`kivi eval`) and performance (`kivi bench`) harnesses; installed as `kivi_benchmarks`."""

from pathlib import Path

RESULTS_DIR = Path(__file__).resolve().parent / "results"  # the committed results, the default --out
