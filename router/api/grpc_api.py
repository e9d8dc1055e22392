"""The gRPC front end, ``dsv3serve.v1.Generation``: the HTTP path behind another wire.

A request is turned into the body an HTTP client would send and then takes exactly the
HTTP path: ``OpenAIServer.prepare`` (validation, tokenization, SamplingParams, context
length, router-assigned id), ``OpenAIServer.open`` (the admission slot, the backend's
first chunk), the same backend stream. Failures become status codes (``grpc_code``).

Ray Serve's proxy forwards a status set on the ``RayServegRPCContext`` with the reply of
a unary RPC; a streaming RPC has to raise after setting it (``GrpcAbort``), which Serve
logs as a failed request.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, Awaitable, Callable
from contextlib import aclosing
from typing import Protocol

import grpc

from dsv3serve.metrics import Metrics
from router.api.auth import APIKeyAuth, metadata_value
from router.api.errors import APIError, from_backend_error, internal_error
from router.api.grpc_convert import (
    chat_body,
    completion_body,
    stream_message,
    usage_stream_message,
    whole_response,
)
from router.api.openai_api import OpenAIServer, Prepared
from router.api.openai_response import ResponseBuilder
from router.api.sse import StreamGuard
from router.proto import generate_pb2 as pb
from workers.backend import BackendError, error_from_chunk
from workers.protocol import TokenChunk

logger = logging.getLogger(__name__)

ServerFactory = Callable[[], Awaitable[OpenAIServer]]
Request = pb.GenerateRequest | pb.ChatRequest


class CallContext(Protocol):
    """What the service uses of Serve's ``RayServegRPCContext``."""

    def invocation_metadata(self) -> list[tuple[str, str]]: ...

    def set_code(self, code: grpc.StatusCode) -> None: ...

    def set_details(self, details: str) -> None: ...


_CODES = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    401: grpc.StatusCode.UNAUTHENTICATED,
    404: grpc.StatusCode.NOT_FOUND,
    413: grpc.StatusCode.INVALID_ARGUMENT,
    429: grpc.StatusCode.RESOURCE_EXHAUSTED,
    499: grpc.StatusCode.CANCELLED,
    503: grpc.StatusCode.UNAVAILABLE,
    504: grpc.StatusCode.DEADLINE_EXCEEDED,
}


def grpc_code(http_status: int) -> grpc.StatusCode:
    """The status code for an HTTP-layer status: any other 4xx is INVALID_ARGUMENT."""
    if http_status in _CODES:
        return _CODES[http_status]
    return grpc.StatusCode.INVALID_ARGUMENT if http_status < 500 else grpc.StatusCode.INTERNAL


class GrpcAbort(Exception):
    """Ends a streaming RPC with the status already set on its context."""


def _api_error(exc: Exception) -> APIError:
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, BackendError):
        return from_backend_error(exc)
    logger.error("gRPC request failed", exc_info=exc)
    return internal_error(exc)


async def _drain(builder: ResponseBuilder, first: TokenChunk, guard: StreamGuard) -> None:
    """Record every chunk; an error chunk raises (as a non-streaming HTTP reply does)."""
    chunk: TokenChunk | None = first
    while chunk is not None:
        if chunk.error is not None:
            raise from_backend_error(error_from_chunk(chunk))
        builder.add(chunk)
        chunk = await anext(guard.chunks, None)


class GenerationService:
    """The Generation RPCs over the router's OpenAIServer (built on first use)."""

    def __init__(self, server: ServerFactory, auth: APIKeyAuth, metrics: Metrics) -> None:
        self._server = server
        self.auth = auth
        self.metrics = metrics

    async def complete(self, request: Request, context: CallContext) -> pb.GenerateResponse:
        """Generate / ChatComplete; on failure an empty reply with the status set."""
        try:
            api, prepared = await self._prepare(request, context)
            guard, first = await api.open(prepared)
            builder = ResponseBuilder(prepared.meta)
            try:
                await _drain(builder, first, guard)
            finally:
                await guard.close()
        except asyncio.CancelledError:
            self._answered(grpc.StatusCode.CANCELLED)
            raise
        except Exception as exc:
            self._fail(context, exc)
            return pb.GenerateResponse()
        self._answered(grpc.StatusCode.OK)
        return whole_response(builder)

    async def stream(
        self, request: Request, context: CallContext
    ) -> AsyncGenerator[pb.GenerateStreamResponse, None]:
        """GenerateStream / ChatCompleteStream: new output as it comes, then the usage."""
        try:
            api, prepared = await self._prepare(request, context)
            guard, first = await api.open(prepared)
        except asyncio.CancelledError:
            self._answered(grpc.StatusCode.CANCELLED)
            raise
        except Exception as exc:
            raise self._fail(context, exc) from None
        async with aclosing(self._messages(prepared, first, guard, context)) as messages:
            async for message in messages:
                yield message

    async def health(self, context: CallContext) -> pb.HealthResponse:
        """OK while a prefill and a decode replica answer, else UNAVAILABLE (no key needed)."""
        api: OpenAIServer | None = None
        healthy = False
        try:
            api = await self._server()
            healthy = await api.backend.is_healthy()
        except Exception:
            logger.exception("backend health check failed")
        if api is None or not healthy:
            self._fail(context, APIError(503, "unhealthy: no replica answers", "unavailable"))
            return pb.HealthResponse()
        self._answered(grpc.StatusCode.OK)
        return pb.HealthResponse(
            status="ok", model=api.config.served_model_name, max_model_len=api.config.max_model_len
        )

    async def _prepare(
        self, request: Request, context: CallContext
    ) -> tuple[OpenAIServer, Prepared]:
        refusal = self.auth.refusal(metadata_value(context.invocation_metadata(), "authorization"))
        if refusal is not None:
            raise APIError(401, refusal, "authentication_error", code="invalid_api_key")
        api = await self._server()
        limit = api.config.max_body_bytes
        if request.ByteSize() > limit:
            raise APIError(413, f"request exceeds {limit} bytes", code="request_too_large")
        api.check_capacity()
        if isinstance(request, pb.ChatRequest):
            return api, api.prepare(chat_body(request), "chat")
        return api, api.prepare(completion_body(request), "completion")

    async def _messages(
        self, prepared: Prepared, first: TokenChunk, guard: StreamGuard, context: CallContext
    ) -> AsyncGenerator[pb.GenerateStreamResponse, None]:
        builder = ResponseBuilder(prepared.meta)
        chunk: TokenChunk | None = first
        try:
            while chunk is not None:
                if chunk.error is not None:
                    raise from_backend_error(error_from_chunk(chunk))
                state = builder.add(chunk)
                message = stream_message(chunk, prepared.meta, state.parser)
                if message is not None:
                    yield message
                chunk = await anext(guard.chunks, None)
            yield usage_stream_message(builder)
        except (asyncio.CancelledError, GeneratorExit):
            self._answered(grpc.StatusCode.CANCELLED)
            raise
        except Exception as exc:
            raise self._fail(context, exc) from None
        finally:
            await guard.close()
        self._answered(grpc.StatusCode.OK)

    def _fail(self, context: CallContext, exc: Exception) -> GrpcAbort:
        """Set the status for ``exc`` on ``context``; the exception a stream raises."""
        err = _api_error(exc)
        code = grpc_code(err.status)
        context.set_code(code)
        context.set_details(err.message)
        self._answered(code)
        return GrpcAbort(f"{code.name}: {err.message}")

    def _answered(self, code: grpc.StatusCode) -> None:
        self.metrics.answered("grpc", code.name)
