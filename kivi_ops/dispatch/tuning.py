"""Which CUDA decode-attention kernel runs each shape class (docs/performance.md, "Dispatch"): this
process's earlier pick, else tuning_table.json for the device, else a one-time autotune (median of
CUDA events). Nothing is timed while capturing or tracing: the default runs and the class is tuned
at its next eager call. Context is the cache's capacity, never its lengths (a host sync)."""

from __future__ import annotations

import json
import logging
import statistics
from pathlib import Path
from typing import Callable, NamedTuple, Optional

import torch

log = logging.getLogger(__name__)

TABLE_PATH = Path(__file__).with_name("tuning_table.json")
TABLE_FORMAT = 1
WARMUP, REPS = 2, 5  # the first call may compile (Triton) or load (the C++ kernel)


class ShapeClass(NamedTuple):
    rows: int
    context: int
    group: int
    head_dim: int
    k_bits: int
    v_bits: int
    dtype: str
    paged: bool


class Candidate(NamedTuple):
    implementation: str
    launch: tuple = ()

    def label(self) -> str:
        return self.implementation + "".join(f"/{k}={v}" for k, v in self.launch)


def bucket(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


def shape_class(*, batch: int, kv_heads: int, context: int, query_heads: int, head_dim: int, k_bits: int,
                v_bits: int, dtype: torch.dtype, paged: bool) -> ShapeClass:
    return ShapeClass(bucket(batch * kv_heads), bucket(context), query_heads // kv_heads, head_dim, k_bits, v_bits,
                      str(dtype).removeprefix("torch."), bool(paged))


def entry_key(entry: dict) -> ShapeClass:
    return ShapeClass(*(entry[name] for name in ShapeClass._fields))


def entry_choice(entry: dict) -> Candidate:
    return Candidate(entry["implementation"], tuple(sorted((entry.get("launch") or {}).items())))


def read_table(path: Path = TABLE_PATH) -> dict[str, dict[ShapeClass, Candidate]]:
    if not path.exists():
        return {}
    raw = json.loads(path.read_text())
    if raw.get("format") != TABLE_FORMAT:
        raise ValueError(f"{path}: tuning table format must be {TABLE_FORMAT}, got {raw.get('format')!r}")
    return {device: {entry_key(e): entry_choice(e) for e in body["entries"]} for device, body in raw["devices"].items()}


def cuda_event_seconds(fn: Callable[[], object], warmup: int = WARMUP, reps: int = REPS) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def tracing_or_capturing() -> bool:
    if torch.compiler.is_compiling() or torch.compiler.is_exporting():
        return True
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


_device_names: dict[int, str] = {}


def current_device_name() -> str:
    index = torch.cuda.current_device()
    if index not in _device_names:
        _device_names[index] = torch.cuda.get_device_name(index)
    return _device_names[index]


class Tuner:
    """Picks a candidate per (device, shape class); timer, busy check and device name are injectable."""

    def __init__(self, table: dict[str, dict[ShapeClass, Candidate]], *,
                 timer: Callable[[Callable[[], object]], float] = cuda_event_seconds,
                 busy: Callable[[], bool] = tracing_or_capturing,
                 device_name: Callable[[], str] = current_device_name):
        self.table, self.timer, self.busy, self.device_name = table, timer, busy, device_name
        self.chosen: dict[tuple[str, ShapeClass], Candidate] = {}

    def pick(self, cls: ShapeClass, candidates: list[Candidate], default: Candidate,
             measure: Optional[Callable[[Candidate], object]]) -> Candidate:
        """measure(c) runs c on the call's inputs (None: cannot); default runs while nothing can be timed."""
        key = (self.device_name(), cls)
        known = self.chosen.get(key)
        if known in candidates:
            return known
        listed = self.table.get(key[0], {}).get(cls)
        if listed in candidates:
            return self._settle(key, listed, "the tuning table")
        if measure is None or self.busy():
            return default
        seconds = {c: self.timer(lambda c=c: measure(c)) for c in candidates}
        best = min(candidates, key=seconds.__getitem__)
        timed = ", ".join(f"{c.label()} {seconds[c] * 1e6:.1f} us" for c in candidates)
        return self._settle(key, best, f"autotuned ({timed})")

    def _settle(self, key, candidate: Candidate, why: str) -> Candidate:
        self.chosen[key] = candidate
        log.info("CUDA decode attention on %s for %s: %s, from %s", key[0], _describe(key[1]), candidate.label(), why)
        return candidate


def _describe(cls: ShapeClass) -> str:
    return ", ".join(f"{name}={value}" for name, value in zip(ShapeClass._fields, cls))
