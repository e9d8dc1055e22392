"""An ASGI middleware for Serve's HTTP proxy: one exact admission budget at the door.

Serve's proxy enforces the router deployment's ``max_queued_requests`` loosely: it counts a
request as queued while it is placing it, so a burst of simultaneous arrivals fills the
queue long before the routers are full. On a 16-core host, 600 streams at once against two
routers of ``max_in_flight`` 256 and a queue of 16 (a budget of 528) got 532 refusals, not
72, each after 0.7-1.8 s (docs/perf/admission_two_routers_cpu.md). :class:`ProxyAdmission`
counts the generation requests in flight through this proxy, from arrival to the end of
their response, and answers the first one over the budget with 429 at once, before Serve
routes it: an OpenAI error body and ``Retry-After``. Under the budget, outside bursts, it
adds nothing.

Under a burst, the requests the door admits do not go on at once: Serve routes each in the
proxy's one event loop (about a millisecond), and the last arrivals, the ones refused,
reached the door only after every admitted one ahead of them had been routed (0.5 s into a
burst of 600 from 8 client processes on 16 cores). Once :data:`BURST_ARRIVALS` arrive within
:data:`BURST_WINDOW_S`, the requests admitted wait until arrivals pause for :data:`QUIET_S`, at
most until the burst has lasted :data:`MAX_BURST_S` (:class:`ArrivalsFirst`): the loop then
reaches every arrival of the burst, and answers the refused ones, before Serve routes the
admitted. Outside bursts nothing waits.

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

from starlette.types import ASGIApp, Receive, Scope, Send

from router.api.http_middleware import HTTPMiddleware
from router.api.proxy_refusals import RETRY_AFTER_S, refusal_json

PROXY_ADMISSION_ENV = "DSV3SERVE_PROXY_ADMISSION_LIMIT"
GENERATION_PATHS = ("/chat/completions", "/completions")  # under any route prefix
BURST_ARRIVALS = 16  # arrivals within BURST_WINDOW_S that start a burst (1,600 a second)
BURST_WINDOW_S = 0.01
QUIET_S = 0.005  # a burst ends when no request reached the door for this long
MAX_BURST_S = 0.5  # ... or when it has lasted this long


class ArrivalsFirst:
    """Counts arrivals at the door; from the moment they come as a burst until they pause
    (:data:`QUIET_S`) or the burst has lasted :data:`MAX_BURST_S`, admitted requests wait in
    :meth:`wait`, so that the door reaches the arrivals behind them first (module docstring).
    One watcher task per burst; the waiting requests cost nothing while they wait."""

    def __init__(
        self,
        burst_arrivals: int = BURST_ARRIVALS,
        window_s: float = BURST_WINDOW_S,
        quiet_s: float = QUIET_S,
        max_burst_s: float = MAX_BURST_S,
    ) -> None:
        self.burst_arrivals, self.window_s = burst_arrivals, window_s
        self.quiet_s, self.max_burst_s = quiet_s, max_burst_s
        self._window = (float("-inf"), 0)  # (start, arrivals since)
        self._last = float("-inf")
        self._quiet: asyncio.Event | None = None  # set when the burst ends
        self._watcher: asyncio.Task[None] | None = None  # held: the loop keeps weak refs

    @property
    def in_burst(self) -> bool:
        return self._quiet is not None

    def arrive(self, now: float) -> None:
        """Count one arrival at loop time ``now``; a burst starts at the
        ``burst_arrivals``-th arrival within ``window_s``."""
        self._last = now
        start, count = self._window
        if now - start > self.window_s:
            start, count = now, 0
        self._window = (start, count + 1)
        if count + 1 >= self.burst_arrivals and self._quiet is None:
            self._quiet = asyncio.Event()
            self._watcher = asyncio.get_running_loop().create_task(self._watch(now))

    async def wait(self) -> None:
        """Return when no burst is on (at once outside bursts)."""
        if self._quiet is not None:
            await self._quiet.wait()

    async def _watch(self, started: float) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(self.quiet_s / 2)
            now = loop.time()
            if now - self._last >= self.quiet_s or now - started >= self.max_burst_s:
                break
        quiet, self._quiet = self._quiet, None
        assert quiet is not None
        quiet.set()


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
        self.arrivals.arrive(asyncio.get_running_loop().time())
        if self.in_flight >= self.limit:
            await send_refusal(send)
            return
        self.in_flight += 1
        try:
            await self.arrivals.wait()
            await self.app(scope, receive, send)
        finally:
            self.in_flight -= 1
