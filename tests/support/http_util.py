"""Run an ASGI app under a real uvicorn server in a background thread, for HTTP tests."""

from __future__ import annotations

import contextlib
import random
import socket
import threading
import time
from types import TracebackType
from typing import Any

import uvicorn

# Ports handed to another process to bind later come from here: below Linux's ephemeral
# range (32768-60999), from which every outgoing connection takes its local port (a Ray
# start makes hundreds, and one took a port a test had just picked for Serve's proxy:
# "Failed to bind", 2026-11-29), and above Ray's worker ports (10002-19999).
SPARE_PORTS = (20000, 32000)


def spare_port(count: int = 1, host: str = "127.0.0.1") -> int:
    """A port ``p`` with ``p .. p + count - 1`` free on ``host`` now, from
    :data:`SPARE_PORTS` (released again: for a server another process starts)."""
    rng = random.Random()
    for _ in range(500):
        port = rng.randrange(SPARE_PORTS[0], SPARE_PORTS[1] - count)
        try:
            with contextlib.ExitStack() as stack:
                for p in range(port, port + count):
                    sock = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
                    sock.bind((host, p))
            return port
        except OSError:
            continue
    raise RuntimeError(f"no {count} consecutive free ports in {SPARE_PORTS} on {host}")


def free_socket(host: str = "127.0.0.1") -> socket.socket:
    """A listening-ready TCP socket bound to a free port (the port is never raced for)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, 0))
    return sock


class ServerThread:
    """uvicorn serving ``app`` on a free localhost port from a daemon thread.

    Use as a context manager, or call ``start`` / ``stop``. ``url`` is
    ``http://127.0.0.1:<port>``.
    """

    def __init__(self, app: Any, host: str = "127.0.0.1", graceful_s: int = 2) -> None:
        self._sock = free_socket(host)
        self.host = host
        self.port = self._sock.getsockname()[1]
        config = uvicorn.Config(
            app,
            lifespan="off",
            log_level="warning",
            timeout_graceful_shutdown=graceful_s,
        )
        self.server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._serve, name=f"uvicorn-{self.port}")
        self._thread.daemon = True

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def _serve(self) -> None:
        self.server.run(sockets=[self._sock])

    def start(self, timeout_s: float = 10.0) -> ServerThread:
        """Start serving; returns once the server accepts connections."""
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"uvicorn did not start on {self.url} within {timeout_s} s")
            time.sleep(0.01)
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        """Ask uvicorn to exit and wait for the thread."""
        self.server.should_exit = True
        self._thread.join(timeout_s)
        self._sock.close()
        if self._thread.is_alive():
            raise RuntimeError(f"uvicorn on {self.url} did not stop within {timeout_s} s")

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
