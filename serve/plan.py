"""One engine round as data: the scheduler's frozen Plan (ints and tuples of ints, in execution
order, broadcast as is under TP) and the Output it updates from."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Optional

import torch


@dataclass(frozen=True)
class Swap:
    row: int
    key: int
    pages: tuple[int, ...]


@dataclass(frozen=True)
class Prefill:
    """chunk > 0 (--prefix-caching): in chunks from a cached prefix of `start` tokens (pages[:shared])."""

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

    swap_out: tuple[Swap, ...] = ()
    swap_in: tuple[Swap, ...] = ()
    prefills: tuple[Prefill, ...] = ()
    drops: tuple[int, ...] = ()
    moves: tuple[tuple[int, int], ...] = ()
    table: tuple[tuple[int, tuple[int, ...]], ...] = ()
    decode: tuple[int, ...] = ()
    stop_compiling: bool = False

    def pieces(self) -> list[Plan]:
        swaps = Plan(swap_out=self.swap_out, swap_in=self.swap_in)
        rest = replace(self, swap_out=(), swap_in=(), prefills=())
        return [p for p in (swaps, *(Plan(prefills=(f,)) for f in self.prefills), rest) if p != Plan()]


@dataclass
class Output:

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
