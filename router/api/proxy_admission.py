"""An ASGI middleware for Serve's HTTP proxy: one exact admission budget at the door.

Serve's proxy enforces the router deployment's ``max_queued_requests`` loosely: it counts a
request as queued while it is placing it, so a burst of simultaneous arrivals fills the
queue long before the routers are full. On a 16-core host, 600 streams at once against two
routers of ``max_in_flight`` 256 and a queue of 16 (a budget of 528) got 532 refusals, not
72, each after 0.7-1.8 s (docs/perf/admission_two_routers_cpu.md). :class:`ProxyAdmission`
counts the generation requests in flight through this proxy, from arrival to the end of
their response, and answers the first one over the budget with 429 at once, before Serve
routes it: an OpenAI error body and ``Retry-After``. Under the budget it adds nothing.

The budget is ``router.num_replicas x router.max_in_flight + router.max_queued_requests``
summed over the apps this proxy serves (:func:`router.api.admission.admission_limit`), read from
:data:`PROXY_ADMISSION_ENV` when the proxy starts: ``dsv3serve serve`` sets it before it
starts Ray, and the Helm chart on the head pod, where the proxy runs. Unset (or
``max_queued_requests`` -1), nothing is counted and Serve's own queue decides. With one
proxy per node (Serve's default on several nodes) each proxy holds the whole budget for
its own traffic, and Serve's queue stays behind it.
"""

from __future__ import annotations

import os

from starlette.types import ASGIApp, Receive, Scope, Send

from router.api.http_middleware import HTTPMiddleware
from router.api.proxy_refusals import RETRY_AFTER_S, refusal_json

PROXY_ADMISSION_ENV = "DSV3SERVE_PROXY_ADMISSION_LIMIT"
GENERATION_PATHS = ("/chat/completions", "/completions")  # under any route prefix


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
    proxy (:func:`limit_from_env` when None); the rest get 429 at once. Used from the
    proxy's one event loop: the count is exact."""

    def __init__(self, app: ASGIApp, limit: int | None = None) -> None:
        super().__init__(app)
        self.limit = limit_from_env() if limit is None else limit
        self.in_flight = 0

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.limit is None or not is_generation(scope):
            await self.app(scope, receive, send)
            return
        if self.in_flight >= self.limit:
            await send_refusal(send)
            return
        self.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.in_flight -= 1
