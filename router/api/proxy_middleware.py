"""An ASGI middleware for Serve's HTTP proxy: a cut event stream ends with an error event.

When the router replica serving a streamed completion dies, Serve's proxy is the only
live party left. It has already sent the response head, so it sends nothing more and
returns without the final body message (``proxy.py`` ``send_request_to_replica``
swallows the replica's death once the response has started); uvicorn then drops the
connection, and a client sees a silent cut. :class:`StreamEndGuard` watches every
``text/event-stream`` response passing through the proxy; when one ends (the inner app
returns or raises) without its terminal ``data: [DONE]``, it sends an OpenAI-style
``data: {"error": ...}`` event and ``data: [DONE]`` and closes the body properly, so
OpenAI clients raise an error instead of returning a truncated answer.

Serve loads it from ``RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH`` (:data:`PROXY_CALLBACK`),
read when the proxy actor starts: ``dsv3serve serve`` sets it before starting Ray, and the
Helm chart sets it on the head pod, where the proxy runs.
"""

from __future__ import annotations

import json
import logging

from starlette.middleware import Middleware
from starlette.types import Message, Receive, Scope, Send

from router.api.errors import INTERNAL_ERROR, error_body
from router.api.http_middleware import HTTPMiddleware
from router.api.proxy_admission import ProxyAdmission, limit_from_env
from router.api.proxy_refusals import RefusalBody
from router.api.sse import DONE, sse_event

PROXY_CALLBACK_ENV = "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"
PROXY_CALLBACK = "router.api.proxy_middleware:proxy_middlewares"
STREAM_CUT_CODE = "stream_interrupted"
STREAM_CUT_MESSAGE = (
    "the stream was cut before it finished: the server replica serving it stopped; "
    "retry the request"
)
ROUTER_LOST_CODE = "router_unavailable"
ROUTER_LOST_MESSAGE = (
    "the server replica handling the request stopped before answering; nothing was "
    "generated; retry the request"
)
UNAVAILABLE = "service_unavailable"
RETRY_AFTER_S = "1"
_TAIL_BYTES = len(DONE) + 8
logger = logging.getLogger(__name__)


def proxy_middlewares() -> list[Middleware]:
    """The callback Serve's proxy calls (via :data:`PROXY_CALLBACK_ENV`) for its middlewares:
    cut streams end in-band, the proxy's own refusals get OpenAI bodies
    (:class:`~router.api.proxy_refusals.RefusalBody`) and, with a budget set, the exact
    admission budget at the door (:class:`~router.api.proxy_admission.ProxyAdmission`).
    Serve wraps its proxy in this list in order, so the last entry is the outermost: the
    door comes last, and a refusal runs through nothing else. Without a budget the door is
    left out. (While it was listed first, and so ran inside the other two, even passing
    everything through it made a prefill replica's recovery test 1.5-2 s slower; outermost,
    with a budget of 100000, that test's first new request came 6.8-7.4 s after the kill
    against 6.5-6.6 s without the door: two runs each, 2-core VM, 2026-11-29.)"""
    door = [Middleware(ProxyAdmission)] if limit_from_env() is not None else []
    return [Middleware(StreamEndGuard), Middleware(RefusalBody), *door]


def stream_cut_events() -> bytes:
    """The error event and ``[DONE]`` that end a cut stream."""
    return sse_event(error_body(STREAM_CUT_MESSAGE, INTERNAL_ERROR, code=STREAM_CUT_CODE)) + DONE


class _EventStream:
    """What one HTTP response has sent so far, as far as ending it is concerned."""

    def __init__(self) -> None:
        self.is_sse = False
        self.complete = False  # the final body message went out
        self.tail = b""  # the last bytes of the body
        self.client_gone = False  # the client disconnected: nothing more reaches it

    def saw(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            headers = dict(message.get("headers") or [])
            content_type = headers.get(b"content-type", b"")
            self.is_sse = content_type.split(b";")[0].strip().lower() == b"text/event-stream"
        elif message["type"] == "http.response.body":
            self.tail = (self.tail + message.get("body", b""))[-_TAIL_BYTES:]
            self.complete = not message.get("more_body", False)

    @property
    def done_sent(self) -> bool:
        return self.tail.rstrip().endswith(DONE.rstrip())

    def cut(self, final: bool) -> bool:
        """Whether an event stream is ending (``final``: with this body message) without
        its ``[DONE]``, to a client still there; a stream whose head never went out is
        not ours to end."""
        ending = final or not self.complete
        return self.is_sse and ending and not self.done_sent and not self.client_gone

    def closing_events(self) -> bytes:
        """The error event and ``[DONE]``, after a blank line if an event is unfinished."""
        separator = b"" if not self.tail or self.tail.endswith(b"\n\n") else b"\n\n"
        return separator + stream_cut_events()


class StreamEndGuard(HTTPMiddleware):
    """Pure ASGI middleware: event streams that end without ``[DONE]`` get an error event.

    Other responses, and streams that end with ``[DONE]``, pass through untouched.
    """

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        stream = _EventStream()
        started = False

        async def watched_receive() -> Message:
            message = await receive()
            stream.client_gone = stream.client_gone or message["type"] == "http.disconnect"
            return message

        async def watched_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            if message["type"] == "http.response.body" and stream.is_sse:
                final = not message.get("more_body", False)
                stream.saw(message)
                if final and stream.cut(final=True):
                    await send({**message, "more_body": True})
                    await _finish(send, stream)
                    return
            else:
                stream.saw(message)
            await send(message)

        try:
            await self.app(scope, watched_receive, watched_send)
        except Exception:
            if not started and not stream.client_gone:
                logger.warning("the router replica failed before answering; answering 503")
                await _unavailable(send)
                return
            if not (started and stream.cut(final=False)):
                raise
            logger.exception("an event stream failed in the proxy; ending it with an error")
            await _finish(send, stream)
            return
        if not started and not stream.client_gone:  # Serve's proxy would answer a plain 500
            logger.warning("the router replica died before answering; answering 503")
            await _unavailable(send)
            return
        if started and stream.cut(final=False):
            logger.warning("an event stream ended without [DONE]; ending it with an error")
            await _finish(send, stream)


async def _unavailable(send: Send) -> None:
    """A 503 with an OpenAI error body and ``Retry-After``, for a request whose router
    replica died before it started answering (nothing was generated: safe to retry)."""
    body = json.dumps(error_body(ROUTER_LOST_MESSAGE, UNAVAILABLE, code=ROUTER_LOST_CODE))
    headers = [
        (b"content-type", b"application/json"),
        (b"retry-after", RETRY_AFTER_S.encode()),
        (b"content-length", str(len(body)).encode()),
    ]
    await send({"type": "http.response.start", "status": 503, "headers": headers})
    await send({"type": "http.response.body", "body": body.encode(), "more_body": False})


async def _finish(send: Send, stream: _EventStream) -> None:
    """Send the closing events and the final body message."""
    body = stream.closing_events()
    stream.saw({"type": "http.response.body", "body": body, "more_body": False})
    await send({"type": "http.response.body", "body": body, "more_body": False})
