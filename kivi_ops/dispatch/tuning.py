"""Which CUDA decode-attention kernel runs each shape class: the tuning table, else a one-time autotune.

dispatch.py asks `Tuner.pick` for a decode call (q_len == 1) on CUDA with the kernels eligible for it
(triton_decode, triton_split, cuda_cpp and its split counts). The answer, per (device name, shape
class), comes from, in order:

1. this process's earlier answer (every later call of the class: a dict lookup);
2. the committed table, tuning_table.json, keyed by torch.cuda.get_device_name(): what a GPU run
   measured (its source named in the file), used when its kernel is eligible here;
3. a one-time autotune, as Triton's autotuner does it: each eligible kernel run on the call's own
   inputs, warmed up, then timed over a few reps with CUDA events; the median decides.

Nothing is timed inside a CUDA-graph capture or while torch.compile / torch.export trace (the timing
would be captured or traced): such a call runs the table's kernel or the safe default (dispatch.py's
Triton rule), and the class is tuned at its next eager call. Each class's choice is logged once.

The timer, the "busy" check (capture / tracing) and the device name are injectable, so CPU tests
drive the whole logic with fake kernels and a fake clock. `lab/gpu_tune.py` measures a table on a GPU.

A shape class buckets what decides a kernel's speed and nothing else: rows (batch x kv heads) and
the context (the cache's static capacity per row, never its lengths: reading them would be a host
sync in a CUDA graph) to the next power of two; query heads per kv head, head_dim, key/value bits,
the cache dtype and whether the cache is paged exactly.
"""

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
WARMUP, REPS = 2, 5  # per candidate: the first call may compile (Triton) or load (the C++ kernel)


class ShapeClass(NamedTuple):
    rows: int  # batch x kv heads, to the next power of two
    context: int  # tokens a row can hold, to the next power of two
    group: int  # query heads per kv head
    head_dim: int
    k_bits: int
    v_bits: int
    dtype: str  # "float16", "bfloat16", "float32"
    paged: bool


class Candidate(NamedTuple):
    """One kernel with its launch settings (keywords of its launcher, as sorted pairs)."""
    implementation: str
    launch: tuple = ()

    def label(self) -> str:
        return self.implementation + "".join(f"/{k}={v}" for k, v in self.launch)


def bucket(n: int) -> int:
    """n rounded up to a power of two (1 for n <= 1)."""
    return 1 << max(int(n) - 1, 0).bit_length()


def shape_class(*, batch: int, kv_heads: int, context: int, query_heads: int, head_dim: int, k_bits: int,
                v_bits: int, dtype: torch.dtype, paged: bool) -> ShapeClass:
    return ShapeClass(bucket(batch * kv_heads), bucket(context), query_heads // kv_heads, head_dim, k_bits, v_bits,
                      str(dtype).removeprefix("torch."), bool(paged))


def entry_key(entry: dict) -> ShapeClass:
    """The shape class of one table entry (its fields by name)."""
    return ShapeClass(*(entry[name] for name in ShapeClass._fields))


def entry_choice(entry: dict) -> Candidate:
    return Candidate(entry["implementation"], tuple(sorted((entry.get("launch") or {}).items())))


def read_table(path: Path = TABLE_PATH) -> dict[str, dict[ShapeClass, Candidate]]:
    """{device name: {shape class: candidate}} from a table file ({} if there is none)."""
    if not path.exists():
        return {}
    raw = json.loads(path.read_text())
    if raw.get("format") != TABLE_FORMAT:
        raise ValueError(f"{path}: tuning table format must be {TABLE_FORMAT}, got {raw.get('format')!r}")
    return {device: {entry_key(e): entry_choice(e) for e in body["entries"]} for device, body in raw["devices"].items()}


def cuda_event_seconds(fn: Callable[[], object], warmup: int = WARMUP, reps: int = REPS) -> float:
    """Median seconds of fn() on the current CUDA stream over `reps` timed calls, after `warmup`."""
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
    """Whether timing now would be captured into a CUDA graph or traced by torch.compile / export."""
    if torch.compiler.is_compiling() or torch.compiler.is_exporting():
        return True
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


_device_names: dict[int, str] = {}  # per device index: asked on every eager decode call


def current_device_name() -> str:
    index = torch.cuda.current_device()
    if index not in _device_names:
        _device_names[index] = torch.cuda.get_device_name(index)
    return _device_names[index]


class Tuner:
    """Picks a candidate per (device, shape class): see the module doc. One per process (dispatch.py);
    tests build their own with fakes."""

    def __init__(self, table: dict[str, dict[ShapeClass, Candidate]], *,
                 timer: Callable[[Callable[[], object]], float] = cuda_event_seconds,
                 busy: Callable[[], bool] = tracing_or_capturing,
                 device_name: Callable[[], str] = current_device_name):
        self.table, self.timer, self.busy, self.device_name = table, timer, busy, device_name
        self.chosen: dict[tuple[str, ShapeClass], Candidate] = {}

    def pick(self, cls: ShapeClass, candidates: list[Candidate], default: Candidate,
             measure: Optional[Callable[[Candidate], object]]) -> Candidate:
        """The candidate for cls. measure(c) runs c on the call's inputs (None: the caller cannot run
        kernels, it only decides where they run). default: what runs while nothing can be timed."""
        key = (self.device_name(), cls)
        known = self.chosen.get(key)
        if known in candidates:
            return known
        listed = self.table.get(key[0], {}).get(cls)
        if listed in candidates:
            return self._settle(key, listed, "the tuning table")
        if measure is None or self.busy():
            return default  # not remembered: tuned at the next eager call
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
