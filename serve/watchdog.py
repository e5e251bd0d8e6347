"""The engine's watchdog: a thread beside the engine thread, which sees what that thread cannot
while it is inside a step that does not end (issue 53).

- Requests past their deadline (--request-timeout), waiting, swapped out or running, get their 504
  on time: the watchdog sends the error event, marks the request cancelled and queues its cancel;
  the engine thread frees its row and pages at its next round, as for a client that went away.
- A stall: the engine has requests open and has completed no round (nor a prefill within one) for
  `stall_timeout` seconds (EngineCore.progress_s). /health then answers 503 `engine_stalled` and
  /metrics says so, until the engine moves again; the stall is logged when it starts and ends.

It takes the engine's lock, which the engine thread never holds across a step, and gives up a tick
rather than wait on it.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from typing import Optional

from .request import Failure

log = logging.getLogger("kivi.serve")

STALL_TIMEOUT = 60.0  # seconds (--stall-timeout): far above a decode step or one prompt's prefill on a CPU
TICK_S = 0.05  # how often the watchdog looks: the lateness of a 504, at most


def check_stall_timeout(seconds: float) -> float:
    if not (isinstance(seconds, (int, float)) and math.isfinite(seconds) and seconds > 0):
        raise ValueError(f"stall_timeout (--stall-timeout) must be a finite number of seconds > 0, got {seconds!r}")
    return float(seconds)


class Watchdog:
    def __init__(self, core, stall_timeout: float):
        self.core, self.lock = core, core.lock
        self.stall_timeout = check_stall_timeout(stall_timeout)
        self.reported: Optional[float] = None  # when the stall being reported began (logged once)
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="kivi-watchdog", daemon=True)
        self.thread.start()

    def stall_s(self) -> Optional[float]:
        """Seconds since the engine last made progress with requests open, once past stall_timeout; else None."""
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
        if not self.lock.acquire(timeout=TICK_S):
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
