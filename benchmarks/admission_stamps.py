"""Bench-only, for ``run_admission_cpu.py``: when each request of the burst reached the
door in Serve's proxy, and how late the proxy's event loop ran while it did.

``run_admission_cpu.py`` points Serve's proxy callback (``RAY_SERVE_HTTP_PROXY_CALLBACK_
IMPORT_PATH``) at :func:`stamped_proxy_middlewares`: the project's middlewares
(``router.api.proxy_middleware.proxy_middlewares``) with :class:`DoorStamps` around them
all. Serve wraps the proxy in its callback's list in order, so the list's last entry is
the outermost, and the next one in is the door (``ProxyAdmission``): nothing runs
between a request's entry into :class:`DoorStamps` and the door's check. For each
request carrying :data:`BENCH_ID_HEADER` it keeps the wall time (``time.time()``, one
clock for every process on the host) at which the request entered, and at which its
response head was handed back to uvicorn, with the status. A watcher task samples the
event loop's lateness every :data:`LOOP_TICK_S`. ``GET`` :data:`STAMPS_PATH` answers
both as JSON. Production code never loads this module.
"""

from __future__ import annotations

import asyncio
import json
import time

from starlette.middleware import Middleware
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from router.api.proxy_middleware import proxy_middlewares

BENCH_ID_HEADER = b"x-bench-id"
STAMPS_PATH = "/_bench/door_stamps"
CALLBACK = "admission_stamps:stamped_proxy_middlewares"  # importable from benchmarks/
LOOP_TICK_S = 0.005
LATE_S = 0.002  # loop ticks later than this are kept


def stamped_proxy_middlewares() -> list[Middleware]:
    """The project's proxy middlewares with :class:`DoorStamps` outermost (last)."""
    return [*proxy_middlewares(), Middleware(DoorStamps)]


def bench_id(scope: Scope) -> str | None:
    """The request's :data:`BENCH_ID_HEADER`, or None."""
    for key, value in scope.get("headers") or []:
        if key == BENCH_ID_HEADER:
            return bytes(value).decode()
    return None


class DoorStamps:
    """Pure ASGI middleware: stamps the bench's requests, answers :data:`STAMPS_PATH`."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.requests: list[dict[str, object]] = []
        self.late_ticks: list[tuple[float, float]] = []  # (wall time, seconds late)
        self.ticks = 0
        self.watcher: asyncio.Task[None] | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.watcher is None:
            self.watcher = asyncio.get_running_loop().create_task(self.watch_loop())
        if scope.get("path") == STAMPS_PATH:
            await self.answer_stamps(send)
            return
        key = bench_id(scope)
        if key is None:
            await self.app(scope, receive, send)
            return
        record: dict[str, object] = {"id": key, "arrived": time.time()}
        self.requests.append(record)

        async def stamped_send(message: Message) -> None:
            await send(message)
            if message["type"] == "http.response.start":
                record["head_sent"] = time.time()
                record["status"] = message["status"]

        await self.app(scope, receive, stamped_send)

    async def watch_loop(self) -> None:
        """Sleep :data:`LOOP_TICK_S` again and again; keep each wake-up later than
        :data:`LATE_S`."""
        while True:
            before = time.perf_counter()
            await asyncio.sleep(LOOP_TICK_S)
            late = time.perf_counter() - before - LOOP_TICK_S
            self.ticks += 1
            if late > LATE_S:
                self.late_ticks.append((time.time(), late))

    async def answer_stamps(self, send: Send) -> None:
        body = json.dumps(
            {
                "requests": self.requests,
                "loop_tick_s": LOOP_TICK_S,
                "loop_ticks": self.ticks,
                "loop_late_ticks": self.late_ticks,
            }
        ).encode()
        headers = [(b"content-type", b"application/json")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": body, "more_body": False})
