"""One engine round carried out: a StepPlan's swaps, each admitted prompt's prefill, the decode step
over the smallest bucket, and each row's logits turned into its next token (output.advance).

The engine (engine.py) decides when a round runs and ends the requests an Executor reports
ended; the placement (placement.py) says where each request sits; the runner (runner.py) touches
the model and the cache. The Executor reads and changes the placement under the engine's lock
and calls the runner outside it: a step may take seconds, and handlers must not wait on it.

What fails here ends one request (a prefill, a swap-out to host memory, a row's sampling); what
the runner reports as a tensor-parallel failure (`runner.failure`) is re-raised, for the engine
to end every request."""

from __future__ import annotations

import logging
import threading
import time
from typing import Optional

import torch

from kivi_ops.paged_io import sequence_bytes

from .output import advance
from .paged_options import tail_pages
from .placement import Placement, StepPlan
from .request import HOST_KEYS, Failure, Request
from .runner import Runner

log = logging.getLogger("kivi.serve")

Ended = list[tuple[Request, Optional[Failure]]]  # requests that end, each with its failure (None: done or cancelled)


class Executor:
    def __init__(self, runner: Runner, placement: Placement, lock: threading.Condition, tokenizer, eos: set[int]):
        self.runner, self.placement, self.lock = runner, placement, lock
        self.tokenizer, self.eos = tokenizer, eos
        self.generated_tokens = self.prefix_hits = self.prefix_hit_tokens = 0
        self.decode_rows = 0  # the rows the last decode step ran over (its bucket)
        self.doing = "the round"  # what this round is doing now: a failure no request owns is reported by it
        self.started_s = time.perf_counter()

    def counters(self) -> dict:
        """What /metrics reports of the rounds so far (and of the cached prefixes, with prefix caching)."""
        elapsed = time.perf_counter() - self.started_s
        counters = dict(generated_tokens=self.generated_tokens, decode_rows=self.decode_rows,
                        tokens_per_s=self.generated_tokens / elapsed if elapsed > 0 else 0.0)
        if self.placement.prefix_chunk is not None:
            counters.update(self.placement.prefix_stats(), prefix_hits=self.prefix_hits,
                            prefix_hit_tokens=self.prefix_hit_tokens)
        return counters

    def warm_up(self, stopping) -> bool:
        """One decode step per bucket with no request (every count 0: nothing is stored), which
        builds what serving runs (the compiled step, or the per-op CPU kernels of those shapes);
        then this thread compiles nothing more (Runner.stop_compiling). False if `stopping()`
        said so between two buckets (the server is shutting down)."""
        with torch.inference_mode():
            for rows in self.placement.buckets:
                if stopping():
                    return False
                self.runner.decode([-1] * rows)
        self.runner.stop_compiling()  # every rank's, under tensor parallelism
        return True

    def place(self, plan: StepPlan) -> Ended:
        """A plan's swaps: the preempted requests' pages are saved before anything writes them; the
        resumed ones come back into their rows and new pages (any ids)."""
        ended = []
        for slot, r, pages in plan.preempted:
            log.info("request %s: preempted (swapped out, %d pages)", r.id, len(pages))
            if (failure := self._swap_out(slot, r, pages)) is not None:
                ended.append((r, failure))
        for slot in plan.resumed:
            r = self.placement.rows[slot]
            if (failure := self._swap_in(slot, r)) is not None:
                ended.append((r, failure))
        return ended

    def _swap_in(self, slot: int, r: Request) -> Optional[Failure]:
        """Copy a swapped-out request back into row `slot` and its new pages. If that fails, that
        request alone ends (the copy writes only its row and pages)."""
        self.doing = f"swapping request {r.id} back in"
        try:
            self.runner.load(slot, self.placement.saved_pages(r), r.key)
        except Exception as e:
            if self.runner.failure is not None:
                raise  # not this request's fault: every request ends
            log.exception("request %s: swapping it back in failed", r.id)
            self.runner.drop(r.key)
            return Failure(500, f"the request was preempted and swapping it back in from host memory failed: "
                                f"{type(e).__name__}: {e}")
        finally:
            r.saved = None
        return None

    def _swap_out(self, slot: int, r: Request, pages: list[int]) -> Optional[Failure]:
        """Save a preempted request's pages and row state to host memory. If that fails (host
        memory), that request alone ends: nothing waits for a copy that does not exist."""
        try:
            self.runner.save(slot, pages, r.key)
        except Exception as e:
            if self.runner.failure is not None:
                raise  # not this request's fault: every request ends
            log.exception("request %s: swapping it out failed", r.id)
            self.runner.drop(r.key)  # a rank that saved it drops its copy too
            return Failure(500, "the request was preempted and saving it to host memory failed: "
                                f"{type(e).__name__}: {e}")
        r.saved = len(pages)
        return None

    def prefill(self, slot: int, r: Request) -> Ended:
        """Prefill r's prompt alone into row `slot` and its pages (exactly `kivi generate`'s
        prefill), then sample its first token. A failure ends r alone."""
        try:
            if self.placement.prefix_chunk is not None:
                logits = self._prefill_shared(slot, r)
            else:
                logits = self.runner.prefill(slot, r.prompt_ids, self.placement.prompt_pages(r))
        except Exception as e:
            if self.runner.failure is not None:
                raise  # not this prompt's fault: every request ends
            log.exception("request %s: the prefill failed", r.id)
            return [(r, Failure(500, f"the prefill failed: {type(e).__name__}: {e}"))]
        return self._advance(logits, [slot], "the prompt")

    def _prefill_shared(self, slot: int, r: Request) -> torch.Tensor:
        """--prefix-caching: r's prompt in chunks (Runner.prefill_chunked), starting from its cached
        prefix if the scheduler found one (its shared pages lead r's page list; its tail is a host
        copy the runner keeps under the prefix's key), keeping a tail under a new key at each chunk
        boundary not cached yet; those boundaries are cached once r's pages hold them."""
        hit, r.prefix_hit = r.prefix_hit, None
        start, shared, tail_key = 0, 0, -1
        if hit is not None:
            start, shared, tail_key = hit.num_tokens, len(hit.pages), hit.payload
            self.prefix_hits += 1
            self.prefix_hit_tokens += start
        new = self.placement.new_boundaries(r, start)  # only the engine thread changes prefixes
        keys = [next(HOST_KEYS) for _ in new]
        logits = self.runner.prefill_chunked(slot, r.prompt_ids, self.placement.prompt_pages(r),
                                             self.placement.prefix_chunk, start, shared, tail_key, new, keys)
        cache = self.runner.cache
        with self.lock:
            for b, key in zip(new, keys):  # r holds these pages: they are final, in the pool now
                tail = sequence_bytes(cache, tail_pages(cache, b))  # what save_tail kept
                if not self.placement.cache_prefix(r, b, key, cache.pages_final(b), tail):
                    self.runner.drop(key)
        return logits

    def drop_evicted(self) -> None:
        """Forget the tails of the prefixes evicted this round (after its prefills: a request
        admitted this round may have started from one)."""
        self.doing = "dropping the host copies of evicted prefixes"
        for key in self.placement.take_evicted():
            self.runner.drop(key)

    def decode(self) -> Ended:
        """One step over the smallest bucket that holds the requests, moved into the lowest rows."""
        with self.lock:
            moves = self.placement.compaction()
        self.doing = "moving requests into the lowest rows"
        for src, dst in moves:
            self.runner.move(src, dst)
        with self.lock:
            table = self.placement.table_update()
            active, rows = self.placement.decode_batch()
            tokens = [r.tokens[-1] if r is not None else -1 for r in self.placement.rows[:rows]]
        self.doing = "writing the block table"
        if table is not None:
            self.runner.write_table(table)
        self.doing = "the decode step"
        logits = self.runner.decode(tokens)
        self.decode_rows = rows
        return self._advance(logits[active], active, "a decode step")

    def _advance(self, logits: torch.Tensor, slots: list[int], where: str) -> Ended:
        """logits [len(slots), V], row i for slots[i]: each request's next token (output.advance)."""
        sampled, ended = advance(logits, [self.placement.rows[slot] for slot in slots], self.tokenizer, self.eos,
                                 where)
        self.generated_tokens += sampled
        return ended
