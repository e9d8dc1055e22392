"""An in-process backend: the router's HTTP layer over one AsyncEngine, no Ray.

Used by ``dsv3serve serve --no-ray`` style single-process runs and by HTTP-layer tests.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator

from dsv3serve.engine.async_engine import AsyncEngine
from dsv3serve.engine.engine import Engine, InvalidRequestError
from dsv3serve.engine.request import Request
from dsv3serve.engine.scheduler.sequence import ContextLengthError
from workers.backend import BackendError
from workers.convert import chunk_from_output
from workers.protocol import GenerateRequest, TokenChunk


class InvalidBackendRequest(BackendError):
    """The engine refused the request (bad ids, too long for the pool)."""

    status = 400
    error_type = "invalid_request_error"


class LocalEngineBackend:
    """GenerationBackend over an engine in this process."""

    def __init__(self, engine: Engine) -> None:
        self.engine = AsyncEngine(engine)

    async def generate(self, req: GenerateRequest) -> AsyncGenerator[TokenChunk, None]:
        """Stream the request's chunks; leaving early aborts it in the engine."""
        request = Request(req.request_id, req.params, prompt_ids=list(req.prompt_ids))
        stream = self.engine.generate(request)
        try:
            first = await stream.__anext__()
        except (InvalidRequestError, ContextLengthError) as exc:
            raise InvalidBackendRequest(str(exc)) from None
        except StopAsyncIteration:
            return
        try:
            yield chunk_from_output(first)
            async for out in stream:
                yield chunk_from_output(out)
        finally:
            await stream.aclose()

    async def is_healthy(self) -> bool:
        """False once the engine's step loop died (``EngineDeadError``)."""
        return self.engine.dead is None
