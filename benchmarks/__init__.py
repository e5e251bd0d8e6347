"""Quality (`kivi eval`) and performance (`kivi bench`) harnesses; installed as `kivi_benchmarks`."""

from pathlib import Path

RESULTS_DIR = Path(__file__).resolve().parent / "results"  # the committed results
# Where `kivi bench` and `kivi eval table` write unless told (--out): under the current directory,
# never into the package (an editable install would rewrite tracked files, a normal one site-packages).
DEFAULT_OUT = Path("kivi-results")
