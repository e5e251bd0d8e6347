"""One engine round as data: the scheduler's frozen `Plan` (placement.py makes it), which the runner
carries out (runner.Runner.execute) and tensor parallelism broadcasts as it is (tp.py), and the
`Output` the scheduler updates from (executor.Executor.update). Every field of a plan is an int or
a tuple of ints, in the order the runner carries them out."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Optional

import torch


@dataclass(frozen=True)
class Swap:
    row: int
    key: int  # the request's host key: its saved copy
    pages: tuple[int, ...]


@dataclass(frozen=True)
class Prefill:
    """A prompt into `row` and `pages`. chunk > 0 (--prefix-caching): in chunks, from a cached prefix
    of `start` tokens (its pages: pages[:shared]; its tail: the host copy under tail_key, -1: none),
    keeping a tail under tail_keys[i] at each of `boundaries`."""

    row: int
    key: int
    tokens: tuple[int, ...]
    pages: tuple[int, ...]
    chunk: int = 0
    start: int = 0
    shared: int = 0
    tail_key: int = -1
    boundaries: tuple[int, ...] = ()
    tail_keys: tuple[int, ...] = ()


@dataclass(frozen=True)
class Plan:
    """Swap out (the pages are back in the pool already), swap in, prefill, drop host copies, move
    rows (src, dst), write changed block-table rows (row, pages), one decode step over
    len(decode) rows (decode[row]: its last token, -1: none; (): no step), stop compiling."""

    swap_out: tuple[Swap, ...] = ()
    swap_in: tuple[Swap, ...] = ()
    prefills: tuple[Prefill, ...] = ()
    drops: tuple[int, ...] = ()
    moves: tuple[tuple[int, int], ...] = ()
    table: tuple[tuple[int, tuple[int, ...]], ...] = ()
    decode: tuple[int, ...] = ()
    stop_compiling: bool = False

    def pieces(self) -> list[Plan]:
        """The plan cut where the engine may stop between two prefills: the swaps, each prefill, the rest."""
        swaps = Plan(swap_out=self.swap_out, swap_in=self.swap_in)
        rest = replace(self, swap_out=(), swap_in=(), prefills=())
        return [p for p in (swaps, *(Plan(prefills=(f,)) for f in self.prefills), rest) if p != Plan()]


@dataclass
class Output:
    """What a plan's execution returned: each prefill's logits [1, V] by row, the decode step's
    [rows, V], the exception of each request whose swap or prefill failed (by host key), and the
    prefills the engine skipped (a cancel, an abort or a stop came first)."""

    prefill_logits: dict[int, torch.Tensor] = field(default_factory=dict)
    decode_logits: Optional[torch.Tensor] = None
    failures: dict[int, BaseException] = field(default_factory=dict)
    skipped: set[int] = field(default_factory=set)

    def add(self, other: Output) -> None:
        self.prefill_logits.update(other.prefill_logits)
        self.failures.update(other.failures)
        self.skipped |= other.skipped
        if other.decode_logits is not None:
            self.decode_logits = other.decode_logits
