"""A gRPC stream that ends while Serve's proxy writes to it still cancels its router call.

A client that cancels a server-streaming call, or whose deadline passes, while Serve's
proxy is writing one of the call's messages (for example because the client stopped
reading and the stream's HTTP/2 window is full) ends the call with Serve's handler
suspended at that message's ``yield``. gRPC then drops the handler there. Serve (Ray
2.60, ``proxy.py`` ``send_request_to_replica``) cancels the replica's response only when
a cancellation reaches it while it waits for the replica's next message, so the router
stream ran on to ``max_tokens`` and the decode worker held its KV pages until then.

:func:`guarded_stream` runs Serve's handler on a :class:`CallContext` and, when the call
is dropped at a ``yield``, resumes the handler into its wait for the replica and cancels
that wait: Serve cancels the response, and the router sees the cancellation as for any
other client cancel. Serve's handler then finishes (its access log and status) after gRPC
has freed the call, so the :class:`CallContext` answers from values it kept and ignores
writes from then on: the freed call's own context must not be touched (its ``peer()``
crashed the proxy with a segmentation fault). Each call dropped so leaves one line
(:data:`DROPPED_AT_WRITE`) in the proxy's log.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, Callable, Sequence

import grpc

StreamHandler = Callable[[object, grpc.aio.ServicerContext], AsyncGenerator[bytes, None]]
RESUME_TRIES = 4  # a resumed step that got a message before its cancel is tried again
DROPPED_AT_WRITE = "a gRPC stream was dropped at a write: cancelling its router call"
# this runs in Serve's proxy: Serve's logger writes the proxy's log (logs/serve/proxy_*.log)
logger = logging.getLogger("ray.serve")


class CallEndedError(RuntimeError):
    """A part of a call's context was asked for after gRPC freed the call."""


class CallContext:
    """One call's ``grpc.aio.ServicerContext`` that stays safe to use after the call is
    freed: from :meth:`end` on, ``peer``, ``code`` and ``details`` answer from values kept
    before, the setters do nothing, and anything else raises :class:`CallEndedError`.
    Until then every attribute is the call's own."""

    def __init__(self, context: grpc.aio.ServicerContext) -> None:
        self._context = context
        self._peer = context.peer()
        self._code: grpc.StatusCode | None = None
        self._details = ""
        self._ended = False

    def end(self) -> None:
        """gRPC is freeing the call: keep its status, touch it no more."""
        if not self._ended:
            self._code, self._details = self._context.code(), self._context.details() or ""
            self._ended = True

    def peer(self) -> str:
        return self._peer

    def code(self) -> grpc.StatusCode | None:
        return self._code if self._ended else self._context.code()

    def details(self) -> str | bytes:
        return self._details if self._ended else self._context.details()

    def set_code(self, code: grpc.StatusCode) -> None:
        if not self._ended:
            self._context.set_code(code)

    def set_details(self, details: str) -> None:
        if not self._ended:
            self._context.set_details(details)

    def set_trailing_metadata(self, metadata: Sequence[tuple[str, str | bytes]]) -> None:
        if not self._ended:
            self._context.set_trailing_metadata(metadata)

    def __getattr__(self, name: str) -> object:
        if self._ended:
            raise CallEndedError(f"the gRPC call has ended; its context has no {name!r}")
        return getattr(self._context, name)


async def guarded_stream(
    handler: StreamHandler, request: object, context: grpc.aio.ServicerContext
) -> AsyncGenerator[bytes, None]:
    """Serve's streaming ``handler`` for one call, whose router call is cancelled also when
    gRPC drops the call at one of its ``yield``\\ s."""
    call = CallContext(context)
    messages = handler(request, call)  # type: ignore[arg-type]  # the context's duck type
    try:
        async for message in messages:
            yield message
    except GeneratorExit:  # dropped while this message was being written
        call.end()
        logger.info(DROPPED_AT_WRITE)
        await cancel_replica_call(messages)
        raise


async def cancel_replica_call(messages: AsyncGenerator[bytes, None]) -> None:
    """Resume Serve's streaming handler ``messages``, suspended at a ``yield``, into its
    wait for the replica's next message, and cancel that wait (Serve then cancels the
    replica's response and ends the handler)."""
    for _ in range(RESUME_TRIES):
        step = asyncio.ensure_future(anext(messages))
        await asyncio.sleep(0)  # the step runs down to its wait for the replica
        step.cancel()
        try:
            await step
        except (StopAsyncIteration, asyncio.CancelledError):
            return
        except Exception:  # noqa: BLE001 - the call is over; its error has no reader
            logger.debug("ending a dropped gRPC stream", exc_info=True)
            return
    await messages.aclose()
