"""Relay a worker's streamed chunks to the router's caller, with one error policy."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Callable
from typing import Any

from workers.backend import BackendError, BackendUnavailable, error_from_chunk
from workers.protocol import TokenChunk
from workers.protocol import decode as parse


async def relay(
    stream: Any, request_id: str, who: str, on_first: Callable[[], None] | None = None
) -> AsyncGenerator[TokenChunk, None]:
    """Parse and yield the chunks of a Serve streaming response.

    Before any chunk: a worker's error chunk raises its BackendError and a failed replica
    raises BackendUnavailable (the HTTP layer answers with a status). After one: the
    failure becomes a final error chunk (in-band). ``on_first`` runs when the first item
    arrives. The remote stream is cancelled on every exit (client disconnect included).
    """
    seen, first = 0, True
    try:
        async for raw in stream:
            if first and on_first is not None:
                on_first()
            first = False
            chunk = parse(TokenChunk, raw)
            if chunk.error is not None and seen == 0:
                raise error_from_chunk(chunk)
            seen += 1
            yield chunk
    except (BackendError, asyncio.CancelledError, GeneratorExit):
        raise
    except Exception as exc:  # the replica died mid-stream
        if seen == 0:
            raise BackendUnavailable(f"{who} failed: {type(exc).__name__}") from None
        yield TokenChunk(
            request_id=request_id,
            finished=True,
            finish_reason="error",
            error=f"{who} failed: {type(exc).__name__}",
            error_status=503,
        )
    finally:
        stream.cancel()
