"""Step: what one forward call does with the cache, passed down the call explicitly.

The caller of a forward (the generation loop, the server, an exported program, or the pre-hook
that reads transformers' own arguments) builds one Step and hands it to every layer; nothing about
the call is stored on the cache and read later.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

from torch import Tensor


class Step(NamedTuple):
    """counts: int64 [B] on the cache's device: row b's first counts[b] new tokens are real (right
        padding; the rest are never stored), or None: all of them. A decode step with counts 0 in
        a row stores nothing there (a free slot of a server's batch).
    prefill: the new tokens are the whole prompt of fresh sequences. The cache stores them, and
        attention runs over their exact keys and values (KIVI's Algorithm 1) instead of the cache.
    exact: exported programs, where one graph serves prompts and decode steps: a bool tensor that
        picks the exact attention (True) or the cache's at run time. None elsewhere.
    order: a left-padded prompt batch (transformers' generate()): per row, the token order that
        puts the real tokens first, in order [B, n]; counts then holds their number. The cache
        stores the real tokens only, and outputs go back to the caller's positions."""

    counts: Optional[Tensor] = None
    prefill: bool = False
    exact: Optional[Tensor] = None
    order: Optional[Tensor] = None


DECODE = Step()
