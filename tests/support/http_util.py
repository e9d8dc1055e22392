"""Run an ASGI app under a real uvicorn server in a background thread, for HTTP tests."""

from __future__ import annotations

import socket
import threading
import time
from types import TracebackType
from typing import Any

import uvicorn


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
