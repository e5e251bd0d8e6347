"""What every serve test needs, once: a port nothing else will take, and uvicorn in a thread.

free_port picks below the OS's ephemeral range. A port taken with bind(("127.0.0.1", 0)) and
released comes from that range, which the OS hands to every other bind(0) too: in CI, torchrun's
rendezvous store got the port a test had just picked for `kivi serve`, and the server failed with
"address already in use" (stop 45). Below the range, only another test's free_port can collide, and
it picks at random among ~20K ports and checks that the port binds.
"""

from __future__ import annotations

import contextlib
import random
import socket
import threading
import time
from pathlib import Path

_PORT_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def free_port() -> int:
    """A port on 127.0.0.1 that binds now and that the OS will not hand out to a bind(0)."""
    ephemeral_low = int(_PORT_RANGE.read_text().split()[0]) if _PORT_RANGE.exists() else 32768
    if ephemeral_low <= 11000:  # an unusual range: no room below it, fall back to the OS's choice
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]
    for _ in range(200):
        port = random.randrange(10000, ephemeral_low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in 10000..{ephemeral_low} after 200 tries")


@contextlib.contextmanager
def uvicorn_in_thread(server, timeout_s: float = 30):
    """Runs a uvicorn.Server (configured for 127.0.0.1) in a daemon thread; yields its URL once it
    listens, and stops it afterwards. Whether the engine behind it is ready is the caller's to wait for."""
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.time() + timeout_s
    while not server.started:
        assert time.time() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{server.config.port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
