"""One round executed (the engine may stop between two prefills) and the scheduler updated from its Output."""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import Callable, Optional

import torch

from kivi_ops.cache.paged_io import sequence_bytes

from .output import advance
from .paged_options import tail_pages
from .placement import Placement
from .plan import Output, Plan
from .request import Failure, Request
from .runner import Runner

log = logging.getLogger("kivi.serve")

Ended = list[tuple[Request, Optional[Failure]]]  # None: done or cancelled


class Executor:
    def __init__(self, runner: Runner, placement: Placement, tokenizer, eos: set[int]):
        self.runner, self.placement = runner, placement
        self.tokenizer, self.eos = tokenizer, eos
        self.generated_tokens = self.prefix_hits = self.prefix_hit_tokens = 0
        self.decode_rows = 0
        self.started_s = time.perf_counter()

    def counters(self) -> dict:
        elapsed = time.perf_counter() - self.started_s
        counters = dict(generated_tokens=self.generated_tokens, decode_rows=self.decode_rows,
                        tokens_per_s=self.generated_tokens / elapsed if elapsed > 0 else 0.0)
        if self.placement.prefix_chunk is not None:
            counters.update(self.placement.prefix_stats(), prefix_hits=self.prefix_hits,
                            prefix_hit_tokens=self.prefix_hit_tokens)
        return counters

    def warm_up(self, stopping) -> bool:
        with torch.inference_mode():
            for rows in self.placement.buckets:
                if stopping():
                    return False
                self.runner.execute(Plan(decode=(-1,) * rows))
            self.runner.execute(Plan(stop_compiling=True))
        return True

    def execute(self, plan: Plan, go: Callable[[Optional[int]], bool], progress: Callable[[], None]) -> Output:
        """go(key) before each prefill, go(None) before the rest: False skips it."""
        out = Output()
        for piece in plan.pieces():
            key = piece.prefills[0].key if piece.prefills else None
            failed = {s.row for s in plan.swap_in if s.key in out.failures}
            if piece.decode and failed:  # a row whose swap-in failed holds no sequence to decode
                piece = replace(piece, decode=tuple(-1 if row in failed else t for row, t in enumerate(piece.decode)))
            if (piece.prefills or piece.decode or piece.moves or piece.table) and not go(key):
                if key is None:  # the rest stays undone: every request ends; only the host copies go
                    out.add(self.runner.execute(Plan(drops=piece.drops)))
                    break
                out.skipped.add(key)
                continue
            out.add(self.runner.execute(piece))
            if key is not None:
                progress()
        return out

    def update(self, plan: Plan, out: Output) -> Ended:
        """Under the engine's lock: what became of each request of the plan."""
        ended, gone = [], set()

        def end(r: Request, failure: Optional[Failure]) -> None:
            ended.append((r, failure))
            gone.add(r.key)

        for swaps, what in ((plan.swap_out, "saving it to host memory failed"),
                            (plan.swap_in, "swapping it back in from host memory failed")):
            for s in swaps:
                if s.key in out.failures and (r := self.placement.find(s.key)) is not None:
                    e = out.failures[s.key]
                    log.error("request %s: %s", r.id, what, exc_info=e)
                    r.saved = None
                    end(r, Failure(500, f"the request was preempted and {what}: {type(e).__name__}: {e}"))
        for p in plan.prefills:
            r = self.placement.find(p.key)
            if r is None or r.key in gone:
                continue
            if p.key in out.skipped:
                if r.cancelled:
                    end(r, None)
                continue
            if p.key in out.failures:
                e = out.failures[p.key]
                log.error("request %s: the prefill failed", r.id, exc_info=e)
                end(r, Failure(500, f"the prefill failed: {type(e).__name__}: {e}"))
                continue
            if p.chunk:
                self._cache_prefixes(r, p)
            for r_, failure in self._advance(out.prefill_logits[p.row], [self.placement.rows.index(r)], "the prompt"):
                end(r_, failure)
        if out.decode_logits is not None:
            self.decode_rows = len(plan.decode)
            rows = [row for row, token in enumerate(plan.decode) if token >= 0
                    and self.placement.rows[row] is not None and self.placement.rows[row].key not in gone]
            if rows:
                ended += self._advance(out.decode_logits[rows], rows, "a decode step")
        return ended

    def _cache_prefixes(self, r: Request, p) -> None:
        if p.start:
            self.prefix_hits += 1
            self.prefix_hit_tokens += p.start
        cache = self.runner.cache
        for b, key in zip(p.boundaries, p.tail_keys):
            tail = sequence_bytes(cache, tail_pages(cache, b))
            if not self.placement.cache_prefix(r, b, key, cache.pages_final(b), tail):
                self.placement.dropped.append(key)

    def _advance(self, logits: torch.Tensor, slots: list[int], where: str) -> Ended:
        sampled, ended = advance(logits, [self.placement.rows[slot] for slot in slots], self.tokenizer, self.eos,
                                 where)
        self.generated_tokens += sampled
        return ended
