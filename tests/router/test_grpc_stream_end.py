"""router/api/grpc_stream_end.py on a real in-process ``grpc.aio`` server: the
:class:`CallContext` a handler gets passes through to its call until ``end`` and answers
from kept values after, and :func:`guarded_stream` dropped at a ``yield`` cancels the
stream handler's wait for the next message. The stream handler stands in for Serve's
(it waits on a queue where Serve waits for the router replica)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, Awaitable, Callable

import grpc

from router.api import grpc_stream_end
from router.api.grpc_stream_end import DROPPED_AT_WRITE, CallContext, CallEndedError, guarded_stream

Handler = Callable[[bytes, grpc.aio.ServicerContext], Awaitable[bytes]]
Answer = tuple[grpc.StatusCode, str, tuple[tuple[str, str], ...]]


async def call_once(handler: Handler) -> Answer:
    """Serve ``handler`` as one unary method on loopback, call it once; the client's status
    code, details and trailing metadata."""
    server = grpc.aio.server()
    method = grpc.unary_unary_rpc_method_handler(handler)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("t.S", {"M": method}),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = channel.unary_unary("/t.S/M")(b"", metadata=(("who", "test"),), timeout=30)
            await call
            trailing = await call.trailing_metadata()
            return await call.code(), await call.details(), tuple(trailing or ())
    except grpc.aio.AioRpcError as err:
        return err.code(), err.details() or "", tuple(err.trailing_metadata() or ())
    finally:
        await server.stop(None)


def test_call_context_passes_through_until_end_then_answers_from_kept_values() -> None:
    seen: dict[str, object] = {}

    async def handler(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        call = CallContext(context)
        seen["peer"] = (call.peer(), context.peer())
        seen["metadata"] = dict(call.invocation_metadata())  # any attribute, before end
        call.set_code(grpc.StatusCode.ALREADY_EXISTS)
        call.set_details("kept")
        call.set_trailing_metadata((("kept", "1"),))
        seen["before"] = (call.code(), call.details())
        call.end()
        call.set_code(grpc.StatusCode.INTERNAL)  # after end: the call no longer hears these
        call.set_details("dropped")
        call.set_trailing_metadata((("dropped", "1"),))
        call.end()  # a second end keeps the first one's values
        seen["after"] = (call.code(), call.details(), call.peer())
        try:
            seen["ended"] = call.invocation_metadata()
        except CallEndedError as err:
            seen["ended"] = err
        return b"ok"

    code, details, trailing = asyncio.run(call_once(handler))
    peer, own_peer = seen["peer"]  # type: ignore[misc]
    assert peer == own_peer and peer.startswith("ipv4:127.0.0.1:")
    assert seen["metadata"]["who"] == "test"  # type: ignore[index]
    assert seen["before"] == (grpc.StatusCode.ALREADY_EXISTS, "kept")
    assert seen["after"] == (grpc.StatusCode.ALREADY_EXISTS, "kept", peer)
    ended = seen["ended"]
    assert isinstance(ended, CallEndedError) and "invocation_metadata" in str(ended)
    assert (code, details) == (grpc.StatusCode.ALREADY_EXISTS, "kept")
    assert ("kept", "1") in trailing and ("dropped", "1") not in trailing


class RecordingHandler(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def test_a_stream_dropped_at_a_yield_cancels_the_handlers_wait() -> None:
    """Dropped at its first ``yield`` (gRPC closing it mid-write), the guarded stream
    resumes the handler into its wait for the next message and cancels it; the handler's
    writes after that (as Serve's status and access log) no longer reach the call, and the
    proxy's log gets one line."""
    events: list[str] = []

    async def serve_handler(
        request: object, context: grpc.aio.ServicerContext
    ) -> AsyncGenerator[bytes, None]:
        replica: asyncio.Queue[bytes] = asyncio.Queue()
        replica.put_nowait(b"first")
        try:
            while True:
                yield await replica.get()
        except asyncio.CancelledError:
            events.append("wait cancelled")
            context.set_code(grpc.StatusCode.CANCELLED)
            events.append(f"peer {context.peer()}")
            raise

    async def handler(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        stream = guarded_stream(serve_handler, request, context)
        events.append((await anext(stream)).decode())
        await stream.aclose()  # gRPC dropping the call at the yield
        return b"ok"

    log = RecordingHandler()
    logger, level = grpc_stream_end.logger, grpc_stream_end.logger.level
    logger.addHandler(log)
    logger.setLevel(logging.INFO)
    try:
        code, _, _ = asyncio.run(call_once(handler))
    finally:
        logger.removeHandler(log)
        logger.setLevel(level)
    assert events[:2] == ["first", "wait cancelled"] and events[2].startswith("peer ipv4:")
    assert code == grpc.StatusCode.OK  # the handler's CANCELLED came after end: ignored
    assert log.messages.count(DROPPED_AT_WRITE) == 1
