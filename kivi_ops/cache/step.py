"""Step: what one forward call does with the cache, passed to every layer, never stored."""

from __future__ import annotations

from typing import NamedTuple, Optional

from torch import Tensor


class Step(NamedTuple):
    """counts: int64 [B], the real (first) new tokens of each right-padded row, or None: all.
    prefill: the whole prompt of fresh sequences, attended over its exact keys and values.
    exact: exported programs: a bool tensor choosing exact (prompt) or cache attention at run time.
    order: a left-padded prompt batch: per row the order [B, n] that puts the real tokens first."""

    counts: Optional[Tensor] = None
    prefill: bool = False
    exact: Optional[Tensor] = None
    order: Optional[Tensor] = None


DECODE = Step()
