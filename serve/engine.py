"""Continuous batching over a static or paged cache: the engine behind `kivi serve`.

Each row of the cache is a slot. One engine thread owns the model and the cache and loops:

1. schedule: the placement (placement.py: the queue, the rows, the block manager's scheduler)
   plans the round, for both layouts: a paged cache's pages, or a static cache seen as one page
   of max_seq_len tokens per row (runner.RowPages: admit while a row is free, never preempt).
   Preempted requests are swapped out, swapped-out ones come back, waiting ones are admitted
   (FIFO) into free rows; each new prompt is prefilled alone in a batch-1 staging cache (exactly
   `kivi generate`'s prefill: exact attention, then quantization) and copied into the request's
   row and pages (the other rows are untouched), so an admission costs the prompt alone, not a
   forward over every row;
2. step: one decode step over the smallest decode bucket that holds the running rows, counts 1
   for rows with a request and 0 for free rows (nothing is stored for those), compiled once per
   bucket with static shapes, so requests coming and going never recompile it;
3. output (output.advance): each request samples its own token (its own temperature, top-p and
   seeded generator), checks EOS, stop strings and max_tokens, and a finished, stopped, failed or
   cancelled request frees its row and pages at once.

Per-row lengths and statistics keep rows independent: a greedy completion equals `kivi generate`
of the same prompt alone, whatever else shares the batch. Failures are isolated the same way: a
prompt whose prefill fails, a row whose logits are not finite, or a sampler or tokenizer error ends
that request alone (an "error" event naming the cause, logged with the request id) and the other
rows go on; only an error in the batched decode step itself, which no single row owns, ends them
all. A fault outside the step (a bug in the plan or the bookkeeping) ends every request with a
503 and the engine refuses new ones (`failure`, /health), rather than leaving them to time out.
Handlers talk to the engine through `submit` and the request's event queue (thread-safe
callbacks).

With --paged --prefix-caching (PagedServing.prefix_chunk) a prompt is prefilled in chunks at fixed
boundaries instead (generate.prefill_chunked), starting from the longest cached prefix the
scheduler found: its shared pages and its tail are copied into the staging cache
(Runner.prefill_chunked, prefix_cache.py; the runner keeps each cached prefix's tail under an int
key, on every rank), and each new boundary is cached on the way (block_manager.py holds the page
references and evicts least recently used prefixes before it preempts).

Work is bounded: `max_waiting` caps the queue beyond the free slots (submit refuses with 503), a
cancelled request (its client went away) leaves its row at the next step, `request_timeout` ends
requests older than it (504), and `drain` / `abort` end what is left at shutdown with an error
event each (503), so that every handler answers or closes its stream. Before it is `ready`, one
step with no request runs per decode bucket, so that what requests run is compiled first (the
compiled step with --compile, else the per-op CPU kernels) and no client, and no running stream,
ever waits on a compile (`_warm_up`).

The engine decides; its runner (runner.py) is the only thing that touches the model and the
cache (prefill into a row or pages, swap out and in, the block table, the decode step). Under
torchrun that runner also sends each action to the other ranks (tp.py); if they fail, the
runner says so (`runner.failure`) and the engine ends every request with a 503 and refuses new ones.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Optional

import torch

from .output import advance
from .paged_options import PagedServing, decode_buckets, prefix_caching
from .placement import Placement
from .request import HOST_KEYS, Failure, Request, RequestError
from .runner import Runner

log = logging.getLogger("kivi.serve")


class Engine:
    def __init__(self, model, tokenizer, *, method: str, kivi_config, slots: int, max_seq_len: int,
                 compile: bool = False, max_waiting: Optional[int] = None, request_timeout: Optional[float] = None,
                 paging: Optional[PagedServing] = None, make_runner: Callable[..., Runner] = Runner,
                 eos_token_ids: Optional[set[int]] = None):
        """max_waiting: the most requests queued for a slot (None: no bound); beyond it submit()
        refuses with 503. request_timeout: seconds from submit() after which a request, waiting or
        running, ends with a 504 error (None: none). paging: a paged cache (a pool of pages shared
        by `slots` rows, block_manager.py) instead of static rows of max_seq_len tokens.
        make_runner: builds what carries out the engine's decisions on the model and the cache
        (runner.Runner; tensor parallelism: tp.LeaderRunner). eos_token_ids: the tokens that end a
        completion (None: the tokenizer's; an empty set runs every request to max_tokens)."""
        self.model, self.tokenizer, self.compile = model, tokenizer, compile
        self.max_waiting, self.request_timeout = max_waiting, request_timeout
        self.slots, self.max_seq_len, self.device = slots, max_seq_len, model.device
        self.runner = make_runner(model, method=method, kivi_config=kivi_config, slots=slots, max_seq_len=max_seq_len,
                                  paging=paging, compile=compile)
        self.cache = self.runner.cache  # read here for sizes only; the runner changes it
        prefix_chunk, max_prefixes = prefix_caching(paging, self.cache, max_seq_len)
        buckets = decode_buckets(slots, paging.decode_buckets) if paging is not None else (slots,)
        self.placement = Placement(self.runner.layout, slots, buckets, prefix_chunk, max_prefixes,
                                   report_pages=self.runner.paged)
        if eos_token_ids is None:
            eos = tokenizer.eos_token_id
            eos_token_ids = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
        self.eos = set(eos_token_ids)
        self.lock = threading.Condition()
        self.generated_tokens = self.prefix_hits = self.prefix_hit_tokens = 0
        self.decode_rows = 0  # the rows the last decode step ran over (its bucket)
        self.started_s = time.perf_counter()
        # Lifecycle: ready once the decode step has run over every bucket (_warm_up; /health says so);
        # draining refuses new requests; abort() from another thread records its failure in
        # pending_abort and the engine thread ends the requests; stopped: that thread has returned.
        self.ready = threading.Event()
        self.warmup_error: Optional[str] = None
        self.draining = self.stopping = self.stopped = False
        self.drain_timer: Optional[threading.Timer] = None
        self.pending_abort: Optional[Failure] = None
        self.failure: Optional[str] = None  # why this engine's thread died (a bug): it refuses every request
        self.thread = threading.Thread(target=self._loop, name="kivi-engine", daemon=True)
        self.thread.start()

    @property
    def step_fn(self):
        """The decode step the runner calls (tests slow it down or inject failures through it)."""
        return self.runner.step_fn

    @step_fn.setter
    def step_fn(self, fn) -> None:
        self.runner.step_fn = fn

    # ---------------------------------------------------------------- handler side

    def submit(self, request: Request) -> None:
        """Queue a request (FIFO). Raises RequestError when it can never fit a slot."""
        if not request.prompt_ids:
            raise RequestError("the prompt is empty (no tokens); give text to continue", param="prompt")
        if (refused := self.capacity_error(len(request.prompt_ids), request.max_tokens)) is not None:
            raise refused
        self.placement.submit_keys(request)
        if request.seed is not None:
            request.generator = torch.Generator(device=self.device).manual_seed(request.seed)
        if self.request_timeout is not None:
            request.deadline_s = request.submitted_s + self.request_timeout
        with self.lock:
            if (refused := self.admission_error()) is not None:
                raise refused
            self.placement.waiting.append(request)
            self.lock.notify()

    def capacity_error(self, prompt_tokens: int, max_tokens: int, *, at_least: bool = False) -> Optional[RequestError]:
        """The refusal of a request that could never fit (Placement.capacity_error), else None."""
        return self.placement.capacity_error(prompt_tokens, max_tokens, self.max_seq_len, at_least=at_least)

    def admission_error(self) -> Optional[RequestError]:
        """Why a request arriving now would be refused (503: shutting down, or the queue is full),
        else None. submit() asks under the lock; a handler may ask first, before tokenizing."""
        with self.lock:
            if (failure := self.runner.failure or self.failure) is not None:
                return RequestError(f"the server cannot serve: {failure}", status=503,
                                    code="tensor_parallel_failure" if self.runner.failure else "engine_failure")
            if self.draining:
                return RequestError("the server is shutting down", status=503, code="server_shutting_down")
            queued = self.placement.queued_beyond_free_rows()
            if self.max_waiting is not None and queued >= self.max_waiting:
                return RequestError(f"the server is busy: every slot is in use and {queued} request(s) wait "
                                    f"(--max-waiting); retry later", status=503, code="server_busy",
                                    headers={"Retry-After": "1"})
        return None

    def cancel(self, request: Request) -> None:
        """The client went away: the engine frees its row (or drops it from the queue) next."""
        with self.lock:
            request.cancelled = True
            if request in self.placement.waiting:
                self.placement.leave(request)
            self.lock.notify()

    def stats(self) -> dict:
        with self.lock:
            running = len(self.placement.running())
            elapsed = time.perf_counter() - self.started_s
            by_rank = self.runner.cache_bytes_by_rank()
            stats = dict(running=running, waiting=len(self.placement.waiting), slots_used=running, slots_free=self.slots - running,
                         cache_bytes=sum(by_rank), cache_bytes_by_rank=by_rank, tp_size=len(by_rank),
                         generated_tokens=self.generated_tokens, decode_rows=self.decode_rows,
                         tokens_per_s=self.generated_tokens / elapsed if elapsed > 0 else 0.0)
            stats.update(self.placement.page_stats())
            if self.placement.prefix_chunk is not None:
                stats.update(self.placement.prefix_stats(), prefix_hits=self.prefix_hits,
                             prefix_hit_tokens=self.prefix_hit_tokens)
            return stats

    def snapshot(self) -> dict:
        """Where each request sits, the queue's included (Placement.snapshot)."""
        with self.lock:
            return self.placement.snapshot()

    def check(self) -> None:
        """The placement's invariants (tests): call while the engine is idle or paused."""
        with self.lock:
            self.placement.check()

    def drain(self, timeout: float, message: str = "the server shut down before this request finished") -> None:
        """Refuse new requests from now on; after `timeout` seconds, end the ones still waiting or
        running with an error (abort)."""
        with self.lock:
            self.draining = True
            if self.drain_timer is None:
                self.drain_timer = threading.Timer(timeout, self.abort, args=(f"{message} (--shutdown-timeout {timeout:g} s)",))
                self.drain_timer.daemon = True
                self.drain_timer.start()

    def abort(self, message: str = "the server is stopping", code: str = "server_shutting_down") -> None:
        """End every waiting, running and swapped-out request with a 503 error event and refuse new
        ones: their handlers answer or close their streams cleanly. Called from another thread (a
        signal handler, drain's timer), it only records the abort and wakes the engine thread,
        which ends them at the top of its next round: mid-step, that thread uses those rows,
        pages and host copies outside the lock, so only it may release them. Called from the
        engine thread (_stop_serving), or once that thread has stopped, it ends them at once."""
        with self.lock:
            self.draining = True
            if self.pending_abort is None:  # the first abort's message wins; later ones find nothing left
                self.pending_abort = Failure(503, message, code)
            if threading.current_thread() is self.thread or self.stopped:
                self._end_aborted()
            self.lock.notify()

    def _end_aborted(self) -> None:
        """Under the lock, on the engine thread (or once it has stopped): carry out a pending abort."""
        failure, self.pending_abort = self.pending_abort, None
        if failure is None:
            return
        ended = self.placement.requests()
        for r in ended:  # every handler hears first, even if freeing a request fails (a placement bug)
            r.cancelled = True
            r.emit("error", failure)
        for r in ended:
            self._end(r)

    def close(self) -> None:
        """Stop the engine thread. New requests are refused, and every request still open ends
        with one 503 error event (an abort() before keeps its message: the server's shutdown
        aborts first), so no handler or stream waits forever on a closed engine."""
        with self.lock:  # a reentrant lock: abort() takes it again
            self.stopping = True
            self.abort("the engine was closed")
            if self.drain_timer is not None:
                self.drain_timer.cancel()
            self.lock.notify()
        self.thread.join(timeout=30)
        if self.thread.is_alive():  # a step that does not end (a hung runner): say so, the caller goes on
            log.warning("the engine thread did not stop within 30 s of close()")

    # ---------------------------------------------------------------- engine thread

    def _warm_up(self) -> None:
        """Compile what serving runs before /health says ready, and nothing after: one decode step
        per bucket with no request (every count 0: nothing is stored) builds the compiled step
        (--compile) or, without it, the per-op CPU kernels of those shapes (kernels/cpu_compiled.py).
        Then this thread stops compiling: a shape met later (the one-token last chunk of a
        prompt, a one-token prompt) runs the reference ops, a few ms slower, instead of stalling
        every running stream for the seconds of a compile (issue 43 measured 20.8 s)."""
        try:
            with torch.inference_mode():
                for rows in self.placement.buckets:
                    self.runner.decode([-1] * rows)
        except Exception as e:
            what = "the compiled decode step" if self.compile else "the decode step's CPU kernels"
            log.exception("%s failed to build", what)
            self.warmup_error = f"{what} failed to build: {type(e).__name__}: {e}"
            return
        self.runner.stop_compiling()  # every rank's, under tensor parallelism
        self.ready.set()

    def _loop(self) -> None:
        try:
            self._run()
        except Exception as e:  # a bug outside the batched step (the plan, bookkeeping): fail fast, not hang
            log.exception("the engine thread failed")
            self.failure = f"the engine thread failed: {type(e).__name__}: {e}"
            self._stop_serving(self.failure, "engine_failure")
        finally:
            with self.lock:  # an abort recorded while this thread was leaving: abort() cannot see it ran
                self.stopped = True
                self._end_aborted()

    def _run(self) -> None:
        """nano-vllm's step: schedule -> run -> output, until closed."""
        self._warm_up()
        while True:
            if self.runner.failure is not None:  # tensor parallelism: a rank died or fell out of step
                self._stop_serving(self.runner.failure, "tensor_parallel_failure")
                return
            with self.lock:
                while not self.stopping and self.pending_abort is None and self.placement.idle():
                    if not self.lock.wait(self.runner.heartbeat_s):
                        break  # idle for heartbeat_s: the runner's flush() below tells the other ranks
                self._end_aborted()  # no step is running now: the rows, pages and host copies are ours
                if self.stopping:
                    self.runner.close()
                    return
                self._end_cancelled_and_overdue()
                plan = self.placement.plan()
            try:
                with torch.inference_mode():
                    self._place(plan)
                    if plan.admitted:
                        self._prefill(plan.admitted)
                    for key in self.placement.take_evicted():
                        self.runner.drop(key)
                    if self.placement.running():
                        self._decode()
                    self.runner.flush()
            except Exception as e:  # the batched step failed: no single row owns it, so every row ends
                if self.runner.failure is not None:
                    continue  # every request ends with a 503 (_stop_serving)
                running = self.placement.running()
                log.exception("the decode step failed; ending the %d running request(s)", len(running))
                for _, r in running:
                    self._fail(r, f"the decode step failed: {type(e).__name__}: {e}")

    def _stop_serving(self, failure: str, code: str) -> None:
        """The engine cannot serve any more: end every request with a 503 and refuse new ones
        (admission_error); /health says so."""
        log.error("the engine stops: %s", failure)
        self.ready.clear()
        self.abort(f"the server cannot serve: {failure}", code=code)

    def _place(self, plan) -> None:
        """Carry out a plan's swaps: the preempted requests' pages are saved before anything writes
        them; the resumed ones come back into their rows and new pages (any ids)."""
        for slot, r, pages in plan.preempted:
            log.info("request %s: preempted (swapped out, %d pages)", r.id, len(pages))
            self._swap_out(slot, r, pages)
        for slot in plan.resumed:
            r = self.placement.rows[slot]
            self.runner.load(slot, self.placement.saved_pages(r), r.key)
            r.saved = None

    def _swap_out(self, slot: int, r: Request, pages: list[int]) -> None:
        """Save a preempted request's pages and row state to host memory. If that fails (host
        memory), that request alone ends: the others go on, and nothing waits for a copy that does
        not exist."""
        try:
            self.runner.save(slot, pages, r.key)
        except Exception as e:
            if self.runner.failure is not None:
                raise  # not this request's fault: every request ends (_stop_serving)
            log.exception("request %s: swapping it out failed", r.id)
            self.runner.drop(r.key)  # a rank that saved it drops its copy too
            self._fail(r, f"the request was preempted and saving it to host memory failed: {type(e).__name__}: {e}")
            return
        r.saved = len(pages)

    def _end(self, r: Request, failure: Optional[Failure] = None) -> None:
        """Under the lock: r ends wherever it is (the queue, host memory, a row), with an error
        event if it failed; its row and pages go back (Placement.leave), the runner drops its host copy."""
        if failure is not None:
            r.emit("error", failure)
        self.placement.leave(r)
        if r.saved is not None:
            self.runner.drop(r.key)
            r.saved = None

    def _fail(self, r: Request, message: str, status: int = 500, code: str = "generation_failed") -> None:
        with self.lock:
            self._end(r, Failure(status, message, code))

    def _end_cancelled_and_overdue(self) -> None:
        """Under the lock: cancelled requests leave; those past their deadline (request_timeout),
        waiting, swapped out or running, end with a 504."""
        now = time.perf_counter()
        for r in self.placement.requests():
            if r.cancelled:
                self._end(r)
            elif r.deadline_s is not None and now > r.deadline_s:
                self._end(r, Failure(504, f"the request ran longer than {self.request_timeout:g} s (--request-timeout)",
                                     "timeout"))

    def _prefill(self, admitted: list[int]) -> None:
        """Prefill each admitted prompt alone; one that fails ends its own request only. A round may
        admit many prompts (seconds each on a CPU), so between two prefills the engine heeds what
        came meanwhile: a pending abort ends every request now, and a request cancelled (or every
        one, once close() was called) leaves its row unprefilled; else close() would wait out the
        whole round and give up, leaving this thread running torch code at interpreter exit."""
        for slot in admitted:
            with self.lock:  # one look at the abort, close() and cancel: close() sets its abort and stopping together
                self._end_aborted()  # between two runner calls: the rows and pages are ours
                r = self.placement.rows[slot]
                if r is not None and (r.cancelled or self.stopping):
                    self._end(r)
                    r = None
            if r is None:
                continue  # ended by an abort (or close()), or cancelled
            try:
                if self.placement.prefix_chunk is not None:
                    logits = self._prefill_shared(slot, r)
                else:
                    logits = self.runner.prefill(slot, r.prompt_ids, self.placement.prompt_pages(r))
            except Exception as e:
                if self.runner.failure is not None:
                    raise  # not this prompt's fault: every request ends (_stop_serving)
                log.exception("request %s: the prefill failed", r.id)
                self._fail(r, f"the prefill failed: {type(e).__name__}: {e}")
                continue
            self._advance(logits, [slot], "the prompt")

    def _prefill_shared(self, slot: int, r: Request) -> torch.Tensor:
        """--prefix-caching: r's prompt in chunks (Runner.prefill_chunked), starting from its cached
        prefix if the scheduler found one (its shared pages lead r's page list; its tail is a host
        copy the runner keeps under the prefix's key), keeping a tail under a new key at each chunk
        boundary not cached yet; those boundaries are cached once r's pages hold them. Returns the
        logits."""
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
        with self.lock:
            for b, key in zip(new, keys):  # r holds these pages: they are final, in the pool now
                if not self.placement.cache_prefix(r, b, key, self.cache.pages_final(b)):
                    self.runner.drop(key)
        return logits

    def _decode(self) -> None:
        """One step over the smallest bucket that holds the requests, moved into the lowest rows."""
        with self.lock:
            moves = self.placement.compaction()
        for src, dst in moves:
            self.runner.move(src, dst)
        with self.lock:
            table = self.placement.table_update()
            active, rows = self.placement.decode_batch()
            tokens = [r.tokens[-1] if r is not None else -1 for r in self.placement.rows[:rows]]
        if table is not None:
            self.runner.write_table(table)
        logits = self.runner.decode(tokens)
        self.decode_rows = rows
        self._advance(logits[active], active, "a decode step")

    def _advance(self, logits: torch.Tensor, slots: list[int], where: str) -> None:
        """logits [len(slots), V], row i for slots[i]: each request's next token (output.advance);
        those that end here leave their rows."""
        sampled, ended = advance(logits, [self.placement.rows[slot] for slot in slots], self.tokenizer, self.eos, where)
        self.generated_tokens += sampled
        with self.lock:
            for r, failure in ended:
                self._end(r, failure)
