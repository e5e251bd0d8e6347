"""Idle and slow clients time out, open connections stay below the descriptor limit, and accept()
errors are logged at a bounded rate: gaps uvicorn's h11 leaves (docs/serve.md, Connection limits)."""

from __future__ import annotations

import asyncio
import os
import resource
import time
from dataclasses import dataclass
from typing import Optional

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from .app import error
from .engine import log

TIMEOUT_KEEP_ALIVE = 5.0  # uvicorn's default (vLLM's too)
READ_TIMEOUT = 30.0
# Descriptors kept free beyond those open at start: torch, tokenizers and Inductor open files later.
DESCRIPTOR_RESERVE = 64
ACCEPT_LOG_INTERVAL = 10.0


@dataclass(frozen=True)
class ConnectionLimits:
    max_connections: int
    timeout_keep_alive: float = TIMEOUT_KEEP_ALIVE
    read_timeout: float = READ_TIMEOUT


def descriptor_limit() -> int:
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return 2**20 if soft == resource.RLIM_INFINITY else soft


def descriptors_open() -> int:
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return 0


def listen_backlog() -> int:
    return max(16, min(2048, descriptor_limit() // 16))


def connection_cap() -> int:
    """Connections this process can hold; twice the backlog is kept free (accept takes a backlog per pass)."""
    return descriptor_limit() - descriptors_open() - DESCRIPTOR_RESERVE - 2 * listen_backlog()


def raw_response(status: int, reason: str, message: str, code: str) -> bytes:
    """A whole closing response with OpenAI's error object, for a connection no request cycle can answer."""
    body = error(status, message, code=code).body
    head = (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            "connection: close\r\n\r\n")
    return head.encode("ascii") + body


class BoundedH11Protocol(H11Protocol):

    def __init__(self, *args, limits: ConnectionLimits, **kwargs):
        super().__init__(*args, **kwargs)
        self.limits = limits
        self.read_deadline: Optional[asyncio.TimerHandle] = None
        self.idle_since = 0.0

    def idle(self) -> bool:
        return self.read_deadline is None and (self.cycle is None or self.cycle.response_complete)

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self.idle_since = self.loop.time()
        open_ = [c for c in self.connections if not (c.transport and c.transport.is_closing())]
        if len(open_) > self.limits.max_connections and not self.evict_idlest(open_):
            self.transport.write(raw_response(
                503, "Service Unavailable", f"the server holds its most connections ({self.limits.max_connections}, "
                "--max-connections), each in a request; retry later", "too_many_connections"))
            self.transport.close()
            return
        # uvicorn arms this timer only after a response; from the start, a silent connection ends too.
        self.timeout_keep_alive_task = self.loop.call_later(self.timeout_keep_alive, self.timeout_keep_alive_handler)

    def evict_idlest(self, connections: list) -> bool:
        idle = [c for c in connections if c is not self and isinstance(c, BoundedH11Protocol) and c.idle()]
        if not idle:
            return False
        min(idle, key=lambda c: c.idle_since).timeout_keep_alive_handler()
        return True

    def data_received(self, data: bytes) -> None:
        if self.read_deadline is None:
            self.read_deadline = self.loop.call_later(self.limits.read_timeout, self.read_timed_out)
        super().data_received(data)

    def read_timed_out(self) -> None:
        """Past IDLE / SEND_BODY (DONE, or MUST_CLOSE for urllib) a request arrived whole: leave it alone."""
        self.read_deadline = None
        if self.transport.is_closing() or self.conn.their_state not in (h11.IDLE, h11.SEND_BODY):
            return
        if self.cycle is None or not self.cycle.response_started:
            self.transport.write(raw_response(
                408, "Request Timeout", f"the request did not arrive whole within {self.limits.read_timeout:g} s "
                "(--read-timeout)", "request_timeout"))
        self.transport.close()  # a request cycle waiting for its body sees a disconnect

    def send_400_response(self, msg: str) -> None:
        self.transport.write(raw_response(
            400, "Bad Request", "the request is not valid HTTP/1.1: its request line or a header (Content-Length, "
            "...) is malformed", "invalid_http_request"))
        self.transport.close()

    def on_response_complete(self) -> None:
        if self.read_deadline is not None:
            self.read_deadline.cancel()
            self.read_deadline = None
        self.idle_since = self.loop.time()
        super().on_response_complete()

    def connection_lost(self, exc) -> None:
        if self.read_deadline is not None:
            self.read_deadline.cancel()
            self.read_deadline = None
        super().connection_lost(exc)


class AcceptErrorLog:
    """accept() failures logged at most once per `interval` seconds, with a count."""

    def __init__(self, interval: float = ACCEPT_LOG_INTERVAL):
        self.interval, self.last, self.suppressed = interval, float("-inf"), 0

    def __call__(self, loop: asyncio.AbstractEventLoop, context: dict) -> None:
        if not context.get("message", "").startswith("socket.accept() out of system resource"):
            loop.default_exception_handler(context)
            return
        now = time.monotonic()
        if now - self.last < self.interval:
            self.suppressed += 1
            return
        also = f" ({self.suppressed} more since the last report)" if self.suppressed else ""
        log.error(
            "accept() failed: %s%s; new connections wait until descriptors free up (lower --max-connections or "
            "raise ulimit -n)", context.get("exception"), also)
        self.last, self.suppressed = now, 0


def new_event_loop() -> asyncio.AbstractEventLoop:
    loop = asyncio.SelectorEventLoop()
    loop.set_exception_handler(AcceptErrorLog())
    return loop


def uvicorn_config(app, *, host: str, port: int, limits: ConnectionLimits, **options) -> uvicorn.Config:
    import functools

    return uvicorn.Config(app, host=host, port=port, log_level="warning", loop=f"{__name__}:new_event_loop",
                          http=functools.partial(BoundedH11Protocol, limits=limits),
                          timeout_keep_alive=limits.timeout_keep_alive,
                          backlog=min(listen_backlog(), limits.max_connections), **options)


def check_connection_limits(max_connections: Optional[int], parser) -> int:
    cap = connection_cap()
    if cap < 1:
        parser.error(f"the descriptor limit (ulimit -n {descriptor_limit()}) leaves no room for connections: "
                     f"{descriptors_open()} descriptors are open and {DESCRIPTOR_RESERVE + 2 * listen_backlog()} are "
                     "kept in reserve; "
                     "raise ulimit -n")
    if max_connections is None:
        return cap
    if max_connections > cap:
        parser.error(f"--max-connections {max_connections} exceeds what the descriptor limit allows: {cap} (ulimit -n "
                     f"{descriptor_limit()}, less the {descriptors_open()} descriptors open and "
                     f"{DESCRIPTOR_RESERVE + 2 * listen_backlog()} kept in reserve); lower it or raise ulimit -n")
    return max_connections

