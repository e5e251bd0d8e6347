"""The engine behind `kivi serve`: one thread runs rounds (plan -> execute -> update) over the
cache's rows; handlers talk to it through a queue of commands (docs/serve.md)."""

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
    """What handlers call: refusals are decided here, the rest is a command to the engine thread."""

    def __init__(self, model, tokenizer, config: ServeConfig, *, make_runner: Callable[..., Runner] = Runner):
        self.config, self.tokenizer, self.device = config, tokenizer, model.device
        # read at each submit(): tests change them on a running engine
        self.max_waiting, self.request_timeout = config.max_waiting, config.request_timeout
        self.runner = make_runner(model, **config.runner_options())
        self.cache = self.runner.cache
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
        return self.runner.step_fn

    @step_fn.setter
    def step_fn(self, fn) -> None:
        self.runner.step_fn = fn

    def submit(self, request: Request) -> None:
        """Queue a request; RequestError if it can never fit or is refused now."""
        if not request.prompt_ids:
            raise RequestError("the prompt is empty (no tokens); give text to continue", param="prompt")
        if (refused := self.capacity_error(len(request.prompt_ids), request.max_tokens)) is not None:
            raise refused
        self.placement.submit_keys(request)
        if request.seed is not None:
            request.generator = torch.Generator(device=self.device).manual_seed(request.seed)
        if self.request_timeout is not None:
            request.deadline_s = request.submitted_s + self.request_timeout
        with self.lock:  # check and enqueue at once: a racing submit counts this one
            if (refused := self.admission_error()) is not None:
                raise refused
            self.core.send("submit", request)

    def capacity_error(self, prompt_tokens: int, max_tokens: int, *, at_least: bool = False) -> Optional[RequestError]:
        return self.placement.capacity_error(prompt_tokens, max_tokens, self.config.max_seq_len,
                                              at_least=at_least)

    def admission_error(self) -> Optional[RequestError]:
        """The 503 a request arriving now gets (failure, shutting down, queue full), else None."""
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
        failure = self.runner.failure or self.core.failure
        if failure is None:
            return None
        return RequestError(f"the server cannot serve: {failure}", status=503,
                            code="tensor_parallel_failure" if self.runner.failure else "engine_failure")

    def health_error(self) -> Optional[RequestError]:
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
        request.cancelled = True  # at once: _go skips its prefill, waiting() no longer counts it
        self.core.send("cancel", request)

    def stats(self) -> dict:
        with self.lock:
            running, by_rank = len(self.placement.running()), self.runner.cache_bytes_by_rank()
            return dict(running=running, waiting=len(self.core.waiting()), slots_used=running,
                        slots_free=self.config.slots - running, cache_bytes=sum(by_rank), cache_bytes_by_rank=by_rank,
                        tp_size=len(by_rank), stalled=int(self.watchdog.stall_s() is not None),
                        **self.executor.counters(), **self.placement.page_stats())

    def snapshot(self) -> dict:
        with self.lock:
            return dict(self.placement.snapshot(), waiting=[r.id for r in self.core.waiting()])

    def check(self) -> None:
        with self.lock:
            self.placement.check()

    def drain(self, timeout: float, message: str = "the server shut down before this request finished") -> None:
        """Refuse new requests; abort the rest after `timeout` seconds."""
        with self.lock:
            self.core.draining = True
            if self.drain_timer is None:
                self.drain_timer = threading.Timer(timeout, self.abort, args=(f"{message} (--shutdown-timeout {timeout:g} s)",))
                self.drain_timer.daemon = True
                self.drain_timer.start()

    def abort(self, message: str = "the server is stopping", code: str = "server_shutting_down") -> None:
        self.core.abort(message, code)

    def close(self, timeout: float = 30.0) -> bool:
        """Stop the engine thread, ending every open request with a 503; False if it outlives `timeout`."""
        with self.lock:
            if self.drain_timer is not None:
                self.drain_timer.cancel()
        self.watchdog.stop()
        return self.core.stop(timeout)


class EngineCore:
    """The engine thread: it alone changes the scheduler, applying the commands others send()."""

    def __init__(self, runner: Runner, placement: Placement, executor: Executor, *, compile: bool):
        self.runner, self.placement, self.executor = runner, placement, executor
        self.compile = compile
        # Guards `commands` and the scheduler for readers; this thread never holds it across a step.
        self.lock = threading.Condition()
        self.commands: collections.deque[tuple[str, object]] = collections.deque()
        self.ready = threading.Event()
        self.warmup_error: Optional[str] = None
        self.draining = self.stopping = self.stopped = False
        self.failure: Optional[str] = None  # why this thread died: every request is refused
        # last round or prefill completed; None while idle: the watchdog's clock
        self.progress_s: Optional[float] = None
        self.thread = threading.Thread(target=self._loop, name="kivi-engine", daemon=True)
        self.thread.start()

    def send(self, verb: str, arg) -> None:
        """From any thread: ("submit" | "cancel", Request) or ("abort", Failure), applied in order."""
        with self.lock:
            self.commands.append((verb, arg))
            self.lock.notify()

    def queued(self) -> list[Request]:
        return [arg for verb, arg in self.commands if verb == "submit"]

    def waiting(self) -> list[Request]:
        """Under the lock: requests waiting for a row, queued submits included, cancelled ones not."""
        return [r for r in (*self.placement.waiting, *self.queued()) if not r.cancelled]

    def open_requests(self) -> list[Request]:
        return [*self.placement.requests(), *self.queued()]

    def abort(self, message: str, code: str) -> None:
        """End every open request with a 503, refuse new ones: queued, or at once on this thread or once it stopped."""
        with self.lock:
            self.draining = True
            self.send("abort", Failure(503, message, code))  # the first abort wins: later ones find no one
            if threading.current_thread() is self.thread or self.stopped:
                self._apply()

    def stop(self, timeout: float) -> bool:
        with self.lock:  # reentrant: abort() takes it again
            self.stopping = True
            self.abort("the engine was closed", "server_shutting_down")
        self.thread.join(timeout=timeout)
        if self.thread.is_alive():
            log.warning("the engine thread did not stop within %g s of close() (%s)", timeout,
                        "a step is still running" if self.ready.is_set() else "still warming up")
            return False
        return True

    def _loop(self) -> None:
        try:
            self._warm_up()
            while self._round():
                pass
        except Exception as e:  # a bug outside the batched step: fail fast, not hang
            log.exception("the engine thread failed")
            self.failure = f"the engine thread failed: {type(e).__name__}: {e}"
            self._stop_serving(self.failure, "engine_failure")
        finally:
            with self.lock:  # an abort queued while this thread was leaving
                self.stopped = True
                self._apply()

    def _warm_up(self) -> None:
        """Compile every shape serving runs before ready, nothing after (a compile would stall every stream)."""
        try:
            if not self.executor.warm_up(lambda: self.stopping):
                return
        except Exception as e:
            what = "the compiled decode step" if self.compile else "the decode step's CPU kernels"
            log.exception("%s failed to build", what)
            self.warmup_error = f"{what} failed to build: {type(e).__name__}: {e}"
            return
        self.ready.set()

    def _round(self) -> bool:
        if self.runner.failure is not None:
            self._stop_serving(self.runner.failure, "tensor_parallel_failure")
            return False
        with self.lock:
            while not self.stopping and not self.commands and self.placement.idle():
                self.progress_s = None
                if not self.lock.wait(self.runner.heartbeat_s):
                    break  # the runner's flush() below heartbeats the other ranks
            if self.progress_s is None:
                self.progress_s = time.perf_counter()
            self._apply()  # no step runs: the rows, pages and host copies are ours
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
                self._drop(self.placement.take_dropped())
            self.runner.doing = "the end of the round (the runner's flush)"
            self.runner.flush()
        except Exception as e:  # no single row owns the batched step: every row ends
            if self.runner.failure is None:
                running, doing = [r for _, r in self.placement.running()], self.runner.doing
                log.exception("%s failed; ending the %d running request(s)", doing, len(running))
                failure = Failure(500, f"{doing} failed: {type(e).__name__}: {e}")
                self._end_all([(r, failure) for r in running])
        self.progress_s = time.perf_counter()
        return True

    def _progress(self) -> None:
        self.progress_s = time.perf_counter()

    def _go(self, key: Optional[int]) -> bool:
        """Between two prefills: heed an abort or close() (skip the rest) and a cancel (skip its prefill)."""
        with self.lock:
            if self.stopping or any(verb == "abort" for verb, _ in self.commands):
                return False
            r = None if key is None else self.placement.find(key)
            return key is None or (r is not None and not r.cancelled)

    def _stop_serving(self, failure: str, code: str) -> None:
        log.error("the engine stops: %s", failure)
        self.ready.clear()
        self.abort(f"the server cannot serve: {failure}", code=code)

    def _apply(self) -> None:
        """Under the lock, with no step running: the queued commands, in order."""
        while self.commands:
            verb, arg = self.commands.popleft()
            if verb == "submit":
                self.placement.waiting.append(arg)
            elif verb == "cancel":
                if arg in self.placement.requests():  # else it ended already
                    self._end(arg)
            else:
                self._end_every(arg)

    def _end_every(self, failure: Failure) -> None:
        ended = self.placement.requests()
        for r in ended:  # every handler hears first, even if freeing one fails
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
        if failure is not None:
            r.emit("error", failure)
        self.placement.leave(r)
        if r.saved is not None:
            self._drop([r.key])
            r.saved = None

    def _drop(self, keys: list[int]) -> None:
        if keys:
            self.runner.execute(Plan(drops=tuple(keys)))
