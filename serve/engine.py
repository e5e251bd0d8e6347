"""Continuous batching over a static or paged cache: the engine behind `kivi serve`.

Each row of the cache is a slot. One engine thread owns the model and the cache and loops, as
nano-vllm's step does:

1. plan: the scheduler (placement.py: the queue, the rows, the block manager's scheduler) makes
   the round's one frozen Plan (plan.py), for both layouts: a paged cache's pages, or a static
   cache seen as one page of max_seq_len tokens per row (runner.RowPages: admit while a row is
   free, never preempt). Preempted requests are swapped out, swapped-out ones come back, waiting
   ones are admitted (FIFO) into free rows;
2. execute (executor.py, runner.py): each new prompt is prefilled alone in a batch-1 staging
   cache (exactly `kivi generate`'s prefill: exact attention, then quantization) and copied into
   the request's row and pages, so an admission costs the prompt alone, not a forward over every
   row; then one decode step over the smallest decode bucket that holds the rows, counts 1 for
   rows with a token and 0 for the others (free rows, and rows prefilled this round: they decode
   from the next one), compiled once per bucket with static shapes, so requests coming and going
   never recompile it;
3. update (Executor.update, output.advance): each request samples its own token (its own
   temperature, top-p and seeded generator), checks EOS, stop strings and max_tokens; a finished,
   stopped, failed or cancelled request frees its row and pages at once (`EngineCore._end`).

Per-row lengths and statistics keep rows independent: a greedy completion equals `kivi generate`
of the same prompt alone, whatever else shares the batch (with --prefix-caching, prompts of R
tokens or more equal the chunked prefill's instead: docs/serve.md). Failures are isolated the same way: a
prompt whose prefill fails, a row whose logits are not finite, or a sampler or tokenizer error ends
that request alone (an "error" event naming the cause, logged with the request id) and the other
rows go on; only an error in what no single row owns (the batched decode step, row moves, the
block table), named in its message, ends them all. A fault outside the step (a bug in the plan or the bookkeeping) ends every request with a
503 and the engine refuses new ones (`failure`, /health), rather than leaving them to time out.
Handlers talk to the engine thread through a queue of commands (submit, cancel, abort), as vLLM's
input and abort queues do, and hear back through the request's `emit` callback.

With --paged --prefix-caching (PagedServing.prefix_chunk) a prompt is prefilled in chunks at fixed
boundaries instead, starting from the longest cached prefix the scheduler found (executor.py,
prefix_cache.py; block_manager.py holds the page references and evicts least recently used
prefixes before it preempts).

Work is bounded: `max_waiting` caps the queue beyond the free slots (submit refuses with 503), a
cancelled request (its client went away) leaves its row at the next step, `request_timeout` ends
requests older than it (504, sent by the watchdog, watchdog.py, on time even while a step runs
long; it also tells /health when no step completes), and `drain` / `abort` end what is left at
shutdown with an error event each (503), so that every handler answers or closes its stream. Before it is `ready`, one
step with no request runs per decode bucket, so that what requests run is compiled first (the
compiled step with --compile, else the per-op CPU kernels) and no client, and no running stream,
ever waits on a compile (`EngineCore._warm_up`).

Engine is what the handlers call (submit, cancel, stats, drain, abort, close); EngineCore is the
engine thread behind it: its rounds and its lifecycle (warm-up and `ready`, the stop, the failure
that ends serving). Only that thread changes the scheduler: handlers, the watchdog and drain's
timer queue commands (EngineCore.send), which it applies at the start of each round
(`_apply`), while no step runs; mid-round it only looks whether an abort is queued or a request
was cancelled, between two prefills. The refusals a handler must answer at once (failure,
draining, a full queue) are decided in the handler, under the lock, counting the queued submits.

The engine decides; its runner (runner.py) is the only thing that touches the model and the
cache. Under torchrun that runner also sends each plan to the other ranks (tp.py); if they
fail, the runner says so (`runner.failure`) and the engine ends every request with a 503 and
refuses new ones.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Callable, Optional

import torch

from .config import ServeConfig
from .executor import Ended, Executor
from .output import eos_token_set
from .paged_options import engine_buckets, prefix_caching
from .placement import Placement
from .plan import Plan
from .request import Failure, Request, RequestError
from .runner import Runner
from .watchdog import Watchdog

log = logging.getLogger("kivi.serve")


class Engine:
    def __init__(self, model, tokenizer, config: ServeConfig, *, make_runner: Callable[..., Runner] = Runner):
        """config: the cache, queue and timeouts (ServeConfig). make_runner: builds what carries out
        the engine's decisions on the model and the cache (runner.Runner; tensor parallelism:
        tp.LeaderRunner)."""
        self.config, self.tokenizer, self.device = config, tokenizer, model.device
        # Read at each submit(), so that they can change on a running engine (tests do).
        self.max_waiting, self.request_timeout = config.max_waiting, config.request_timeout
        self.runner = make_runner(model, **config.runner_options())
        self.cache = self.runner.cache  # read here for sizes only; the runner changes it
        prefix_chunk, max_prefixes, max_prefix_bytes = prefix_caching(config.paging, self.cache, config.max_seq_len)
        self.placement = Placement(self.runner.layout, config.slots, engine_buckets(config.paging, config.slots),
                                   prefix_chunk, max_prefixes, report_pages=self.runner.paged,
                                   max_prefix_bytes=max_prefix_bytes)
        self.executor = Executor(self.runner, self.placement, tokenizer, eos_token_set(tokenizer, config.eos_token_ids))
        self.drain_timer: Optional[threading.Timer] = None
        self.core = EngineCore(self.runner, self.placement, self.executor, compile=config.compile)
        self.lock = self.core.lock  # held, the engine thread applies no command and starts no round
        self.watchdog = Watchdog(self.core, config.stall_timeout)
        self.ready, self.thread = self.core.ready, self.core.thread

    @property
    def step_fn(self):
        """The decode step the runner calls (tests slow it down or inject failures through it)."""
        return self.runner.step_fn

    @step_fn.setter
    def step_fn(self, fn) -> None:
        self.runner.step_fn = fn

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
        with self.lock:  # the check and the enqueue at once: a racing submit counts this one
            if (refused := self.admission_error()) is not None:
                raise refused
            self.core.send("submit", request)

    def capacity_error(self, prompt_tokens: int, max_tokens: int, *, at_least: bool = False) -> Optional[RequestError]:
        """The refusal of a request that could never fit (Placement.capacity_error), else None."""
        return self.placement.capacity_error(prompt_tokens, max_tokens, self.config.max_seq_len,
                                              at_least=at_least)

    def admission_error(self) -> Optional[RequestError]:
        """Why a request arriving now would be refused (503: the engine cannot serve, it is shutting
        down, or the queue is full), else None. submit() asks under the lock; a handler may ask
        first, before tokenizing."""
        with self.lock:
            if (refused := self.failure_error()) is not None:
                return refused
            if self.core.draining:
                return RequestError("the server is shutting down", status=503, code="server_shutting_down")
            queued = len(self.core.waiting()) - self.placement.free_rows()
            if self.max_waiting is not None and queued >= self.max_waiting:
                return RequestError(f"the server is busy: every slot is in use and {queued} request(s) wait "
                                    f"(--max-waiting); retry later", status=503, code="server_busy",
                                    headers={"Retry-After": "1"})
        return None

    def failure_error(self) -> Optional[RequestError]:
        """The 503 of an engine that cannot serve any more (a tensor-parallel rank died, or the
        engine thread failed: every request was ended), else None."""
        failure = self.runner.failure or self.core.failure
        if failure is None:
            return None
        return RequestError(f"the server cannot serve: {failure}", status=503,
                            code="tensor_parallel_failure" if self.runner.failure else "engine_failure")

    def health_error(self) -> Optional[RequestError]:
        """Why /health answers 503 (failure_error, still warming up, or stalled: the watchdog), else None."""
        if (refused := self.failure_error()) is not None:
            return refused
        if not self.ready.is_set():
            return RequestError(self.core.warmup_error or "starting: the decode step is being compiled for each "
                                "decode bucket", status=503, code="not_ready")
        if (stall := self.watchdog.stall_s()) is not None:
            return RequestError(f"the engine has completed no step for {stall:.0f} s with requests open "
                                f"(--stall-timeout {self.watchdog.stall_timeout:g}): a step may be hung; restart the "
                                "server if this lasts", status=503, code="engine_stalled")
        return None

    def cancel(self, request: Request) -> None:
        """The client went away: the engine thread frees its row (or drops it from the queue) next."""
        request.cancelled = True  # at once: no longer counted as waiting, and its prefill is skipped
        self.core.send("cancel", request)

    def stats(self) -> dict:
        with self.lock:
            running, by_rank = len(self.placement.running()), self.runner.cache_bytes_by_rank()
            return dict(running=running, waiting=len(self.core.waiting()), slots_used=running,
                        slots_free=self.config.slots - running, cache_bytes=sum(by_rank), cache_bytes_by_rank=by_rank,
                        tp_size=len(by_rank), stalled=int(self.watchdog.stall_s() is not None),
                        **self.executor.counters(), **self.placement.page_stats())

    def snapshot(self) -> dict:
        """Where each request sits, the queue's included (Placement.snapshot)."""
        with self.lock:
            return dict(self.placement.snapshot(), waiting=[r.id for r in self.core.waiting()])

    def check(self) -> None:
        """The placement's invariants (tests): call while the engine is idle or paused."""
        with self.lock:
            self.placement.check()

    def drain(self, timeout: float, message: str = "the server shut down before this request finished") -> None:
        """Refuse new requests from now on; after `timeout` seconds, end the ones still waiting or
        running with an error (abort)."""
        with self.lock:
            self.core.draining = True
            if self.drain_timer is None:
                self.drain_timer = threading.Timer(timeout, self.abort, args=(f"{message} (--shutdown-timeout {timeout:g} s)",))
                self.drain_timer.daemon = True
                self.drain_timer.start()

    def abort(self, message: str = "the server is stopping", code: str = "server_shutting_down") -> None:
        """End every waiting, running and swapped-out request with a 503 error event (their handlers
        answer or close their streams cleanly) and refuse new ones (EngineCore.abort)."""
        self.core.abort(message, code)

    def close(self, timeout: float = 30.0) -> bool:
        """Stop the engine thread. New requests are refused, and every request still open ends
        with one 503 error event (an abort() before keeps its message: the server's shutdown
        aborts first), so no handler or stream waits forever on a closed engine. Waits up to
        `timeout` seconds for the thread; False if it is still running (a compile, a hung step)."""
        with self.lock:
            if self.drain_timer is not None:
                self.drain_timer.cancel()
        self.watchdog.stop()
        return self.core.stop(timeout)

# ---------------------------------------------------------------- the engine thread


class EngineCore:
    """The engine thread (the module doc). runner, placement, executor: the Engine's;
    compile: whether the decode step is compiled (the warm-up's error names what failed)."""

    def __init__(self, runner: Runner, placement: Placement, executor: Executor, *, compile: bool):
        self.runner, self.placement, self.executor = runner, placement, executor
        self.compile = compile
        # Guards `commands` and the scheduler's state for the threads that read it (stats, the
        # watchdog); this thread holds it while it changes that state, never across a step.
        self.lock = threading.Condition()
        self.commands: collections.deque[tuple[str, object]] = collections.deque()  # (verb, arg), FIFO: send()
        # ready once the decode step has run over every bucket (_warm_up; /health says so); draining
        # refuses new requests; stopping: close() asked; stopped: this thread has returned.
        self.ready = threading.Event()
        self.warmup_error: Optional[str] = None
        self.draining = self.stopping = self.stopped = False
        self.failure: Optional[str] = None  # why this thread died (a bug): the engine refuses every request
        # When this thread last completed a round or a prefill; None while idle (no request open): the watchdog's clock.
        self.progress_s: Optional[float] = None
        self.thread = threading.Thread(target=self._loop, name="kivi-engine", daemon=True)
        self.thread.start()

    def send(self, verb: str, arg) -> None:
        """Queue a command for this thread, from any thread: ("submit", Request), ("cancel", Request)
        or ("abort", Failure). _apply carries them out in order."""
        with self.lock:
            self.commands.append((verb, arg))
            self.lock.notify()

    def queued(self) -> list[Request]:
        """Under the lock: the submitted requests this thread has not applied yet."""
        return [arg for verb, arg in self.commands if verb == "submit"]

    def waiting(self) -> list[Request]:
        """Under the lock: the requests that wait for a row, the queued submits included, the cancelled
        ones (whose cancel is queued) not."""
        return [r for r in (*self.placement.waiting, *self.queued()) if not r.cancelled]

    def open_requests(self) -> list[Request]:
        """Under the lock: every request not ended, the queued submits included."""
        return [*self.placement.requests(), *self.queued()]

    def abort(self, message: str, code: str) -> None:
        """End every waiting, running and swapped-out request with a 503 error event and refuse new
        ones. From another thread (a signal handler, drain's timer) it queues the abort, which this
        thread carries out at the top of its next round (or between two prefills: _go). From this
        thread (_stop_serving), or once it has stopped, it is carried out at once."""
        with self.lock:
            self.draining = True
            self.send("abort", Failure(503, message, code))  # the first abort's message wins: later ones find no one
            if threading.current_thread() is self.thread or self.stopped:
                self._apply()

    def stop(self, timeout: float) -> bool:
        """Stop this thread; every request still open ends with one 503 error event (an abort
        before keeps its message). False if the thread still runs after `timeout` seconds."""
        with self.lock:  # a reentrant lock: abort() takes it again
            self.stopping = True
            self.abort("the engine was closed", "server_shutting_down")
        self.thread.join(timeout=timeout)
        if self.thread.is_alive():  # a compile or a step that does not end (a hung runner): say so, the caller goes on
            log.warning("the engine thread did not stop within %g s of close() (%s)", timeout,
                        "a step is still running" if self.ready.is_set() else "still warming up")
            return False
        return True

    def _loop(self) -> None:
        try:
            self._warm_up()
            while self._round():
                pass
        except Exception as e:  # a bug outside the batched step (the plan, bookkeeping): fail fast, not hang
            log.exception("the engine thread failed")
            self.failure = f"the engine thread failed: {type(e).__name__}: {e}"
            self._stop_serving(self.failure, "engine_failure")
        finally:
            with self.lock:  # an abort queued while this thread was leaving: abort() cannot see it ran
                self.stopped = True
                self._apply()

    def _warm_up(self) -> None:
        """Compile what serving runs before /health says ready, and nothing after (Executor.warm_up):
        a shape met later (the one-token last chunk of a prompt, a one-token prompt) runs the
        reference ops, a few ms slower, instead of stalling every running stream for the seconds
        of a compile (issue 43 measured 20.8 s)."""
        try:
            if not self.executor.warm_up(lambda: self.stopping):
                return  # close() came first: _round stops
        except Exception as e:
            what = "the compiled decode step" if self.compile else "the decode step's CPU kernels"
            log.exception("%s failed to build", what)
            self.warmup_error = f"{what} failed to build: {type(e).__name__}: {e}"
            return
        self.ready.set()

    def _round(self) -> bool:
        """One round: plan -> execute -> update. False once the engine stops."""
        if self.runner.failure is not None:  # tensor parallelism: a rank died or fell out of step
            self._stop_serving(self.runner.failure, "tensor_parallel_failure")
            return False
        with self.lock:
            while not self.stopping and not self.commands and self.placement.idle():
                self.progress_s = None  # idle: nothing is late
                if not self.lock.wait(self.runner.heartbeat_s):
                    break  # idle for heartbeat_s: the runner's flush() below tells the other ranks
            if self.progress_s is None:
                self.progress_s = time.perf_counter()
            self._apply()  # no step is running now: the rows, pages and host copies are ours
            if self.stopping:
                self._drop(self.placement.take_dropped())
                self.runner.close()
                return False
            plan = self.placement.plan()
        try:
            with torch.inference_mode():
                out = self.executor.execute(plan, self._go, self._progress)
            with self.lock:
                self._end_all(self.executor.update(plan, out))
                self._drop(self.placement.take_dropped())  # the round's prefills are done: no one needs them
            self.runner.doing = "the end of the round (the runner's flush)"
            self.runner.flush()
        except Exception as e:  # the batched step failed: no single row owns it, so every row ends
            if self.runner.failure is None:  # else every request ends with a 503 (_stop_serving)
                running, doing = [r for _, r in self.placement.running()], self.runner.doing
                log.exception("%s failed; ending the %d running request(s)", doing, len(running))
                failure = Failure(500, f"{doing} failed: {type(e).__name__}: {e}")
                self._end_all([(r, failure) for r in running])
        self.progress_s = time.perf_counter()
        return True

    def _progress(self) -> None:
        self.progress_s = time.perf_counter()

    def _go(self, key: Optional[int]) -> bool:
        """Whether to run the next prefill (of the request whose host key is `key`; None: the rest of
        the round). A round may admit many prompts (seconds each on a CPU), so between two
        prefills the engine heeds what came meanwhile: a pending abort or close() skips the rest
        of the round, a cancelled request's prefill is skipped; else close() would wait out the
        whole round and give up, leaving this thread running torch code at interpreter exit."""
        with self.lock:
            if self.stopping or any(verb == "abort" for verb, _ in self.commands):
                return False
            r = None if key is None else self.placement.find(key)
            return key is None or (r is not None and not r.cancelled)

    def _stop_serving(self, failure: str, code: str) -> None:
        """The engine cannot serve any more: end every request with a 503 and refuse new ones
        (admission_error); /health says so."""
        log.error("the engine stops: %s", failure)
        self.ready.clear()
        self.abort(f"the server cannot serve: {failure}", code=code)

    def _apply(self) -> None:
        """Under the lock, on this thread (or once it has stopped): carry out the queued commands in order."""
        while self.commands:
            verb, arg = self.commands.popleft()
            if verb == "submit":
                self.placement.waiting.append(arg)
            elif verb == "cancel":
                if arg in self.placement.requests():  # else it ended already (done, or a skipped prefill)
                    self._end(arg)
            else:
                self._end_every(arg)

    def _end_every(self, failure: Failure) -> None:
        """An abort: every open request ends with `failure` (one that was cancelled hears nothing more)."""
        ended = self.placement.requests()
        for r in ended:  # every handler hears first, even if freeing a request fails (a placement bug)
            if not r.cancelled:
                r.cancelled = True
                r.emit("error", failure)
        for r in ended:
            self._end(r)

    def _end_all(self, ended: Ended) -> None:
        with self.lock:
            for r, failure in ended:
                self._end(r, failure)

    def _end(self, r: Request, failure: Optional[Failure] = None) -> None:
        """Under the lock: r ends wherever it is (the queue, host memory, a row), with an error
        event if it failed; its row and pages go back (Placement.leave), the runner drops its host copy."""
        if failure is not None:
            r.emit("error", failure)
        self.placement.leave(r)
        if r.saved is not None:
            self._drop([r.key])
            r.saved = None

    def _drop(self, keys: list[int]) -> None:
        """Under the lock, on this thread: the runner forgets these host copies."""
        if keys:
            self.runner.execute(Plan(drops=tuple(keys)))
