"""An ASGI middleware for Serve's HTTP proxy: the proxy's own refusals get an OpenAI body.

Serve's proxy answers some requests itself, before any router replica sees them: a 429
when every router replica is at ``max_ongoing_requests`` (the admission budget) and the
proxy's queue (``router.max_queued_requests``) is full, a 503 when no router replica can
take requests, a 408 past Serve's request time-out. It sends them as plain text (for
example ``Request dropped due to backpressure (num_queued_requests=..., ...)``), which
OpenAI clients cannot parse. :class:`RefusalBody` replaces such a plain-text 408, 429 or
503 with an OpenAI error body of the same status, keeping its other headers (Serve's
``Retry-After``) and adding ``Retry-After`` where the proxy gave none. A router's own
responses are JSON and pass untouched, as does everything else.
"""

from __future__ import annotations

import json

from starlette.types import Message, Receive, Scope, Send

from router.api.errors import error_body
from router.api.http_middleware import HTTPMiddleware

RATE_LIMITED = "rate_limit_exceeded"
UNAVAILABLE = "service_unavailable"
TIMED_OUT = "timeout"
RETRY_AFTER_S = "1"

CAPACITY_MESSAGE = (
    "the server is at capacity: every router replica is at its admission budget "
    "(router.max_in_flight) and the queue in front of them (router.max_queued_requests) "
    "is full; retry later"
)
# status -> (type and code, message) of the OpenAI body that replaces the proxy's text
_REFUSALS: dict[int, tuple[str, str]] = {
    429: (RATE_LIMITED, CAPACITY_MESSAGE),
    503: (UNAVAILABLE, "no router replica can take the request now; retry later"),
    408: (TIMED_OUT, "the request was not answered within the server's request time-out"),
}


def refusal_json(status: int) -> bytes:
    """The OpenAI error body that replaces the proxy's plain-text refusal of ``status``."""
    kind, message = _REFUSALS[status]
    return json.dumps(error_body(message, kind, code=kind)).encode()


def _is_plain_refusal(message: Message) -> bool:
    """A response head of a status the proxy refuses with, and a body that is not JSON."""
    if message["status"] not in _REFUSALS:
        return False
    headers = dict(message.get("headers") or [])
    content_type = bytes(headers.get(b"content-type", b"")).split(b";")[0].strip().lower()
    return content_type != b"application/json"


def _json_head(head: Message, body: bytes) -> Message:
    """``head`` with a JSON content type and length, its other headers kept, and
    ``Retry-After`` added where it had none."""
    drop = {b"content-type", b"content-length"}
    headers = [(bytes(k), bytes(v)) for k, v in head.get("headers") or [] if k.lower() not in drop]
    if not any(k.lower() == b"retry-after" for k, _ in headers):
        headers.append((b"retry-after", RETRY_AFTER_S.encode()))
    length = str(len(body)).encode()
    headers += [(b"content-type", b"application/json"), (b"content-length", length)]
    return {**head, "headers": headers}


class RefusalBody(HTTPMiddleware):
    """Pure ASGI middleware: a plain-text 408, 429 or 503 (Serve's proxy refusing a request
    itself) becomes the same status with an OpenAI error body; all else passes through."""

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        held: Message | None = None  # a refusal's head, sent once its body has ended

        async def rewriting_send(message: Message) -> None:
            nonlocal held
            if message["type"] == "http.response.start" and _is_plain_refusal(message):
                held = message
                return
            if held is None or message["type"] != "http.response.body":
                await send(message)
                return
            if message.get("more_body", False):
                return  # the proxy's text is dropped; the JSON replaces all of it
            body = refusal_json(held["status"])
            await send(_json_head(held, body))
            await send({"type": "http.response.body", "body": body, "more_body": False})

        await self.app(scope, receive, rewriting_send)
