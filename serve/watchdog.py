"""A thread beside the engine thread that sees what it cannot while inside a long step: requests
past --request-timeout get their 504 on time, and a stall turns /health 503 (docs/serve.md)."""

from __future__ import annotations

import logging
import math
import threading
import time
from typing import Optional

from .request import Failure

log = logging.getLogger("kivi.serve")

STALL_TIMEOUT = 60.0  # far above a decode step or one prompt's prefill on a CPU
TICK_S = 0.05  # the lateness of a 504, at most


def check_stall_timeout(seconds: float) -> float:
    if not (isinstance(seconds, (int, float)) and math.isfinite(seconds) and seconds > 0):
        raise ValueError(f"stall_timeout (--stall-timeout) must be a finite number of seconds > 0, got {seconds!r}")
    return float(seconds)


class Watchdog:
    def __init__(self, core, stall_timeout: float):
        self.core, self.lock = core, core.lock
        self.stall_timeout = check_stall_timeout(stall_timeout)
        self.reported: Optional[float] = None
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="kivi-watchdog", daemon=True)
        self.thread.start()

    def stall_s(self) -> Optional[float]:
        since = self.core.progress_s
        if since is None or not self.core.ready.is_set():
            return None
        age = time.perf_counter() - since
        return age if age > self.stall_timeout else None

    def stop(self) -> None:
        self.stopped.set()
        self.thread.join(timeout=5)

    def _loop(self) -> None:
        while not self.stopped.wait(TICK_S):
            try:
                self._end_overdue()
                self._report()
            except Exception:  # a bug here must not end the watchdog quietly
                log.exception("the engine's watchdog failed a check")

    def _end_overdue(self) -> None:
        if not self.lock.acquire(timeout=TICK_S):  # skip a tick rather than wait behind the engine thread
            return
        try:
            now = time.perf_counter()
            for r in self.core.open_requests():
                if not r.cancelled and r.deadline_s is not None and now > r.deadline_s:
                    r.cancelled = True  # no longer counted as waiting; the engine thread frees it
                    r.emit("error", Failure(504, f"the request ran longer than {r.deadline_s - r.submitted_s:g} s "
                                                 "(--request-timeout)", "timeout"))
                    self.core.send("cancel", r)
        finally:
            self.lock.release()

    def _report(self) -> None:
        stall = self.stall_s()
        if stall is not None and self.reported is None:
            self.reported = time.perf_counter() - stall
            log.error("the engine has completed no step for %.1f s with requests open (--stall-timeout %g): a step "
                      "may be hung; /health answers 503 until it moves", stall, self.stall_timeout)
        elif stall is None and self.reported is not None:
            log.warning("the engine moved again after %.1f s", time.perf_counter() - self.reported)
            self.reported = None
