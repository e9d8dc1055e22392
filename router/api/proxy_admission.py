"""An ASGI middleware for Serve's HTTP proxy: one exact admission budget at the door.

Serve's proxy enforces the router deployment's ``max_queued_requests`` loosely: it counts a
request as queued while it is placing it, so a burst of simultaneous arrivals fills the
queue long before the routers are full. On a 16-core host, 600 streams at once against two
routers of ``max_in_flight`` 256 and a queue of 16 (a budget of 528) got 532 refusals, not
72, each after 0.7-1.8 s (docs/perf/admission_two_routers_cpu.md). :class:`ProxyAdmission`
counts the generation requests in flight through this proxy, from arrival to the end of
their response, and answers the first one over the budget with 429 at once, before Serve
routes it: an OpenAI error body and ``Retry-After``. Under the budget it adds nothing.

Under a burst, the requests the door admits do not go on at once: Serve routes each in the
proxy's one event loop (about a millisecond), and the last arrivals, the ones refused,
reached the door only after every admitted one ahead of them had been routed (0.5 s into a
burst of 600 from 8 client processes on 16 cores). While arrivals come faster than
:data:`BURST_ARRIVALS` per :data:`BURST_WINDOW_S`, an admitted request waits until the loop has
gone :data:`QUIET_TICKS` iterations without a new arrival, at most :data:`MAX_DEFER_S`
(:class:`ArrivalsFirst`), so the refusals go out first. Outside bursts nothing waits.

The budget is ``router.num_replicas x router.max_in_flight + router.max_queued_requests``
summed over the apps this proxy serves (:func:`router.api.admission.admission_limit`), read from
:data:`PROXY_ADMISSION_ENV` when the proxy starts: ``dsv3serve serve`` sets it before it
starts Ray, and the Helm chart on the head pod, where the proxy runs. Unset (or
``max_queued_requests`` -1), nothing is counted and Serve's own queue decides. With one
proxy per node (Serve's default on several nodes) each proxy holds the whole budget for
its own traffic, and Serve's queue stays behind it.
"""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass, field

from starlette.types import ASGIApp, Receive, Scope, Send

from router.api.http_middleware import HTTPMiddleware
from router.api.proxy_refusals import RETRY_AFTER_S, refusal_json

PROXY_ADMISSION_ENV = "DSV3SERVE_PROXY_ADMISSION_LIMIT"
GENERATION_PATHS = ("/chat/completions", "/completions")  # under any route prefix
BURST_ARRIVALS = 16  # arrivals within BURST_WINDOW_S that make a burst (1,600 a second)
BURST_WINDOW_S = 0.01
QUIET_TICKS = 3  # loop iterations from a connection's accept to its request at the door
MAX_DEFER_S = 0.05  # the longest an admitted request waits for the arrivals behind it


@dataclass
class ArrivalsFirst:
    """Counts arrivals at the door and, in a burst, holds admitted requests back until the
    arrivals behind them have reached the door (see the module docstring)."""

    burst_arrivals: int = BURST_ARRIVALS
    window_s: float = BURST_WINDOW_S
    quiet_ticks: int = QUIET_TICKS
    max_defer_s: float = MAX_DEFER_S
    arrivals: int = 0
    _window: tuple[float, int] = field(default=(float("-inf"), 0))

    def arrive(self, now: float) -> bool:
        """Count one arrival at ``now``; whether it came in a burst."""
        self.arrivals += 1
        start, count = self._window
        if now - start > self.window_s:
            start, count = now, 0
        self._window = (start, count + 1)
        return count + 1 >= self.burst_arrivals

    async def wait_for_quiet(self) -> None:
        """Yield to the loop until ``quiet_ticks`` iterations pass with no new arrival, or
        ``max_defer_s`` passed."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.max_defer_s
        seen, quiet = self.arrivals, 0
        while quiet < self.quiet_ticks and loop.time() < deadline:
            await asyncio.sleep(0)
            quiet = quiet + 1 if self.arrivals == seen else 0
            seen = self.arrivals


def limit_from_env() -> int | None:
    """The budget :data:`PROXY_ADMISSION_ENV` holds, or None when it is unset or empty."""
    raw = os.environ.get(PROXY_ADMISSION_ENV, "").strip()
    if not raw:
        return None
    limit = int(raw)
    if limit < 1:
        raise ValueError(f"{PROXY_ADMISSION_ENV}: expected a positive count, got {raw!r}")
    return limit


def is_generation(scope: Scope) -> bool:
    """A POST to a completions route: what the budget counts (health, models, metrics and
    the like pass uncounted)."""
    path = str(scope.get("path", "")).rstrip("/")
    return scope.get("method") == "POST" and path.endswith(GENERATION_PATHS)


async def send_refusal(send: Send) -> None:
    """A 429 with the capacity message's OpenAI body and ``Retry-After``."""
    body = refusal_json(429)
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"retry-after", RETRY_AFTER_S.encode()),
    ]
    await send({"type": "http.response.start", "status": 429, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


class ProxyAdmission(HTTPMiddleware):
    """Pure ASGI middleware: at most ``limit`` generation requests in flight through this
    proxy (:func:`limit_from_env` when None); the rest get 429 at once, and in a burst
    before the admitted ones go on (``arrivals``). Used from the proxy's one event loop:
    the count is exact."""

    def __init__(
        self, app: ASGIApp, limit: int | None = None, arrivals: ArrivalsFirst | None = None
    ) -> None:
        super().__init__(app)
        self.limit = limit_from_env() if limit is None else limit
        self.in_flight = 0
        self.arrivals = arrivals or ArrivalsFirst()

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.limit is None or not is_generation(scope):
            await self.app(scope, receive, send)
            return
        burst = self.arrivals.arrive(asyncio.get_running_loop().time())
        if self.in_flight >= self.limit:
            await send_refusal(send)
            return
        self.in_flight += 1
        try:
            if burst:
                await self.arrivals.wait_for_quiet()
            await self.app(scope, receive, send)
        finally:
            self.in_flight -= 1
