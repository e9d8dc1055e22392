"""What the router's HTTP layer needs from whatever runs the requests (local engine,
colocated Ray workers, or the prefill/decode pair), and the errors a backend may raise.

It lives in ``workers/`` (below ``router/``) so that both the backends here and the
router's HTTP and gRPC layers can import it; it imports no torch.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import Protocol

from workers.protocol import GenerateRequest, TokenChunk


class BackendError(Exception):
    """A request the backend cannot serve; ``status`` is the HTTP status to answer."""

    status = 500
    error_type = "internal_error"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class BackendOverloaded(BackendError):
    """No capacity now (no KV reservation, every replica full): retry later."""

    status = 429
    error_type = "rate_limit_exceeded"


class BackendUnavailable(BackendError):
    """No replica could serve the request (all failed or none is up)."""

    status = 503
    error_type = "service_unavailable"


class GenerationBackend(Protocol):
    """Streams TokenChunks for all ``n`` sequences of a request until each finishes.

    Closing the iterator early (client disconnect) must abort the request everywhere it
    holds resources. Errors before the first chunk raise BackendError; errors after it
    arrive as a chunk with ``error`` set.
    """

    def generate(self, req: GenerateRequest) -> AsyncGenerator[TokenChunk, None]: ...

    async def is_healthy(self) -> bool: ...


class BackendRejected(BackendError):
    """A worker refused the request with a status of its own (e.g. 400: too long)."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status
        self.error_type = "invalid_request_error" if status < 500 else "internal_error"


def error_from_chunk(chunk: TokenChunk) -> BackendError:
    """The exception for a worker's error chunk that arrived before any output."""
    return BackendRejected(chunk.error or "the worker failed", chunk.error_status or 500)
