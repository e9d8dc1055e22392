"""Server-sent events for streamed completions, with cleanup on every exit path.

Whatever ends a stream (the last chunk, a backend error, the client going away, or the
response never being iterated at all), ``StreamGuard.close`` runs exactly once: it frees
the admission slot and closes the backend iterator so the backend aborts the request.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncGenerator

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from dsv3serve.json_types import JSONObject
from router.api.admission import Slot
from router.api.errors import INTERNAL_ERROR, error_body
from router.api.openai_response import ResponseBuilder
from workers.backend import BackendError, error_from_chunk
from workers.protocol import TokenChunk

logger = logging.getLogger(__name__)

DONE = b"data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def sse_event(payload: JSONObject) -> bytes:
    """One ``data: <json>`` event."""
    data = json.dumps(payload, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    return b"data: " + data.encode("utf-8") + b"\n\n"


async def close_quietly(chunks: AsyncGenerator[TokenChunk, None]) -> None:
    """``aclose`` the backend iterator, shielded from the caller's cancellation."""
    aclose = getattr(chunks, "aclose", None)
    if aclose is None:
        return
    task = asyncio.ensure_future(aclose())
    try:
        await asyncio.shield(task)
    except asyncio.CancelledError:
        raise  # the close itself goes on in ``task``
    except Exception:
        logger.exception("closing the backend stream failed")


class StreamGuard:
    """Owns a streamed request's admission slot and backend iterator until closed."""

    def __init__(self, slot: Slot, chunks: AsyncGenerator[TokenChunk, None]) -> None:
        self.slot = slot
        self.chunks = chunks
        self._closed = False

    async def close(self) -> None:
        """Release the slot (synchronously, so cancellation cannot skip it), then aclose."""
        if self._closed:
            return
        self._closed = True
        self.slot.release()
        await close_quietly(self.chunks)


def _in_band_error(exc: BaseException | TokenChunk) -> bytes:
    if isinstance(exc, TokenChunk):
        exc = error_from_chunk(exc)
    if isinstance(exc, BackendError):
        return sse_event(error_body(exc.message, exc.error_type))
    return sse_event(error_body(f"internal server error ({type(exc).__name__})", INTERNAL_ERROR))


async def stream_events(
    builder: ResponseBuilder, first: TokenChunk, guard: StreamGuard, include_usage: bool
) -> AsyncGenerator[bytes, None]:
    """SSE bytes for a stream whose first backend chunk is ``first``; ends with [DONE].

    An error after the first chunk (an error chunk or an exception) becomes an in-band
    ``data: {"error": ...}`` event. Cancellation and GeneratorExit (client gone) propagate;
    ``guard`` is closed on every path.
    """
    try:
        for opening in builder.opening_events():
            yield sse_event(opening)
        chunk: TokenChunk | None = first
        while chunk is not None:
            if chunk.error is not None:
                yield _in_band_error(chunk)
                break
            event = builder.stream_event(chunk)
            if event is not None:
                yield sse_event(event)
            chunk = await anext(guard.chunks, None)
        else:
            if include_usage:
                yield sse_event(builder.usage_event())
        yield DONE
    except Exception as exc:  # not BaseException: cancellation must propagate
        logger.exception("stream %s failed after it started", builder.meta.request_id)
        yield _in_band_error(exc)
        yield DONE
    finally:
        await guard.close()


class SSEResponse(StreamingResponse):
    """A ``text/event-stream`` response that closes its guard even if never iterated."""

    def __init__(self, events: AsyncGenerator[bytes, None], guard: StreamGuard) -> None:
        super().__init__(events, media_type="text/event-stream", headers=SSE_HEADERS)
        self._events = events
        self._guard = guard

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._guard.close()  # covers a stream that was never iterated
            aclose = getattr(self._events, "aclose", None)
            if aclose is not None:
                await aclose()
