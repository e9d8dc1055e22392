"""Serve's gRPC proxy answers ``UNAVAILABLE`` when a router replica dies under a call.

Serve's gRPC proxy turns any error from a replica it has no rule for into ``INTERNAL``
with the exception's text; a router replica that died gives Ray's actor-death message
(class name, actor id, pid, node ip). :func:`add_generation_servicer`, the servicer
function the deploy files list (``grpc_options.grpc_servicer_functions``; Serve calls it
in the proxy when it builds its gRPC server), registers ``dsv3serve.v1.Generation`` and
wraps the proxy's handlers of it: a call that ends ``INTERNAL`` with Ray's actor-death
text ends ``UNAVAILABLE`` with a clean message instead (safe to retry: a unary call got
nothing; a stream says it was cut). The proxy's own refusal when every router replica is
at its budget and its queue is full (``RESOURCE_EXHAUSTED``, "Request dropped due to
backpressure (num_queued_requests=...)") keeps its code and gets the HTTP 429's message.
Every other status passes unchanged. A streamed call also runs through
:func:`~router.api.grpc_stream_end.guarded_stream`, so a call that ends while the proxy
writes to it still cancels its router call.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import AsyncGenerator, Awaitable, Callable
from contextlib import aclosing

import grpc

from router.api.grpc_stream_end import StreamHandler, guarded_stream
from router.api.proxy_refusals import CAPACITY_MESSAGE
from router.proto.generate_pb2_grpc import add_GenerationServicer_to_server

ROUTER_LOST_MESSAGE = (
    "the router replica handling the request stopped before answering; retry the request"
)
STREAM_CUT_MESSAGE = (
    "the stream was cut before it finished: the router replica serving it stopped; "
    "retry the request"
)
# Ray's RayActorError / ActorDiedError / ActorUnavailableError texts, as Serve passes them
_ACTOR_DEATH = re.compile(r"^The actor\b|\bactor_id:")
_BACKPRESSURE = re.compile(r"^Request dropped due to backpressure")  # Serve's refusal
_WRAPPED = "_dsv3serve_clean_status"

Handler = Callable[..., Awaitable[bytes] | AsyncGenerator[bytes, None]]
Factory = Callable[..., Handler]


def add_generation_servicer(servicer: object, server: grpc.aio.Server) -> None:
    """Serve's servicer function for ``dsv3serve.v1.Generation`` (as the generated
    ``add_GenerationServicer_to_server``), with clean statuses for a dead router replica.
    Serve's proxy server routes every method through its ``service_handler_factory``;
    that factory is wrapped before the service is added (once, for every later service)."""
    factory = getattr(server, "service_handler_factory", None)
    if callable(factory) and not getattr(factory, _WRAPPED, False):
        server.service_handler_factory = clean_status_factory(factory)  # type: ignore[attr-defined]
    add_GenerationServicer_to_server(servicer, server)


def _details(context: grpc.aio.ServicerContext) -> str:
    details = context.details() or ""
    return details.decode(errors="replace") if isinstance(details, bytes) else details


def router_died(context: grpc.aio.ServicerContext) -> bool:
    """Whether the call's status is Serve's ``INTERNAL`` for a replica that died."""
    died = _ACTOR_DEATH.search(_details(context))
    return context.code() == grpc.StatusCode.INTERNAL and bool(died)


def proxy_refused(context: grpc.aio.ServicerContext) -> bool:
    """Whether the call's status is the proxy's backpressure refusal."""
    refused = _BACKPRESSURE.search(_details(context))
    return context.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and bool(refused)


def clean_status(context: grpc.aio.ServicerContext, sent_any: bool) -> None:
    """Replace Serve's ``INTERNAL`` for a dead router replica by ``UNAVAILABLE``, and the
    text of the proxy's backpressure refusal by the capacity message."""
    if router_died(context):
        context.set_code(grpc.StatusCode.UNAVAILABLE)
        context.set_details(STREAM_CUT_MESSAGE if sent_any else ROUTER_LOST_MESSAGE)
    elif proxy_refused(context):
        context.set_details(CAPACITY_MESSAGE)


def clean_status_factory(factory: Factory) -> Factory:
    """``factory`` (Serve's ``service_handler_factory``) whose handlers end with
    :func:`clean_status`."""

    def wrapped(*args: object, **kwargs: object) -> Handler:
        handler = factory(*args, **kwargs)
        if inspect.isasyncgenfunction(handler):  # a streamed response
            return _streaming(handler)
        return _unary(handler)  # type: ignore[arg-type]

    setattr(wrapped, _WRAPPED, True)
    return wrapped


def _unary(handler: Callable[..., Awaitable[bytes]]) -> Callable[..., Awaitable[bytes]]:
    async def unary(request: object, context: grpc.aio.ServicerContext) -> bytes:
        response = await handler(request, context)
        clean_status(context, sent_any=False)
        return response

    return unary


def _streaming(handler: StreamHandler) -> StreamHandler:
    async def streaming(
        request: object, context: grpc.aio.ServicerContext
    ) -> AsyncGenerator[bytes, None]:
        sent_any = False
        async with aclosing(guarded_stream(handler, request, context)) as messages:
            async for message in messages:  # dropped here: ``messages`` ends the call
                sent_any = True
                yield message
        clean_status(context, sent_any)

    return streaming
