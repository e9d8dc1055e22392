"""router/api/proxy_middleware.py on its own: the inner app (Serve's proxy) is a fake that plays
back the ASGI messages the proxy sends in each case; the real proxy is in
tests/e2e/test_router_loss.py."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence

import pytest
from starlette.types import Message, Receive, Scope, Send

from router.api.proxy_middleware import (
    ROUTER_LOST_CODE,
    STREAM_CUT_CODE,
    StreamEndGuard,
    proxy_middlewares,
)
from router.api.sse import DONE

SSE_START: Message = {
    "type": "http.response.start",
    "status": 200,
    "headers": [(b"content-type", b"text/event-stream; charset=utf-8")],
}
JSON_START: Message = {
    "type": "http.response.start",
    "status": 200,
    "headers": [(b"content-type", b"application/json")],
}
EVENT = b'data: {"choices":[{"delta":{"content":"Hi"}}]}\n\n'


class FakeProxyApp:
    """Sends ``messages`` in order (first reading one client message when ``reads``), then
    raises ``error`` if one is given."""

    def __init__(
        self, messages: Sequence[Message], error: Exception | None = None, reads: bool = False
    ) -> None:
        self.messages = list(messages)
        self.error = error
        self.reads = reads

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.reads:
            await receive()
        for message in self.messages:
            await send(message)
        if self.error is not None:
            raise self.error


def body(data: bytes, more: bool = True) -> Message:
    return {"type": "http.response.body", "body": data, "more_body": more}


def run_guarded(app: FakeProxyApp) -> list[Message]:
    sent: list[Message] = []

    async def send(message: Message) -> None:
        sent.append(message)

    async def receive() -> Message:
        return {"type": "http.disconnect"}

    scope: Scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions"}
    asyncio.run(StreamEndGuard(app)(scope, receive, send))
    return sent


def events(sent: list[Message]) -> list[str]:
    data = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return [e.removeprefix("data: ") for e in data.decode().split("\n\n") if e]


def assert_ends_with_error(sent: list[Message]) -> None:
    *_, error, done = events(sent)
    assert json.loads(error)["error"]["code"] == STREAM_CUT_CODE
    assert done == "[DONE]"
    assert sent[-1]["type"] == "http.response.body" and not sent[-1]["more_body"]
    assert all(m.get("more_body") for m in sent[1:-1]), "one final body message, the last"


def test_a_stream_that_ends_with_done_passes_untouched() -> None:
    messages = [SSE_START, body(EVENT), body(DONE), body(b"", more=False)]
    assert run_guarded(FakeProxyApp(messages)) == messages


def test_a_stream_whose_replica_died_after_the_head_gets_an_error_event() -> None:
    # What Serve's proxy does when the replica dies mid-stream: it returns without the
    # final body message (the response had started, so it sends nothing more).
    sent = run_guarded(FakeProxyApp([SSE_START, body(EVENT)]))
    assert events(sent)[0] == EVENT.decode().removeprefix("data: ").strip()
    assert_ends_with_error(sent)


def test_an_exception_mid_stream_becomes_an_error_event() -> None:
    sent = run_guarded(FakeProxyApp([SSE_START, body(EVENT)], RuntimeError("actor died")))
    assert_ends_with_error(sent)


def test_a_final_body_without_done_gets_the_error_event_before_it_closes() -> None:
    sent = run_guarded(FakeProxyApp([SSE_START, body(EVENT), body(b"", more=False)]))
    assert_ends_with_error(sent)


def test_an_unfinished_event_is_terminated_before_the_error_event() -> None:
    sent = run_guarded(FakeProxyApp([SSE_START, body(b'data: {"choi')]))
    assert events(sent)[0] == '{"choi'
    assert_ends_with_error(sent)


def test_a_stream_whose_client_left_gets_nothing_more() -> None:
    # The fake client's only message is http.disconnect, which the proxy reads.
    messages = [SSE_START, body(EVENT)]
    assert run_guarded(FakeProxyApp(messages, reads=True)) == messages


def test_other_responses_pass_through() -> None:
    messages = [JSON_START, body(b'{"ok": true', more=True)]
    assert run_guarded(FakeProxyApp(messages)) == messages  # not an event stream


@pytest.mark.parametrize("error", [None, RuntimeError("before the head")])
def test_a_request_whose_router_died_before_the_head_gets_a_503_error_body(
    error: Exception | None,
) -> None:
    # Serve's proxy sends nothing for a replica that died before answering (uvicorn would
    # then answer a plain-text 500), or raises.
    start, *bodies = run_guarded(FakeProxyApp([], error))
    assert start["status"] == 503
    headers = dict(start["headers"])
    assert headers[b"content-type"] == b"application/json" and headers[b"retry-after"] == b"1"
    payload = json.loads(b"".join(b["body"] for b in bodies))
    assert payload["error"]["code"] == ROUTER_LOST_CODE and not bodies[-1]["more_body"]


def test_the_proxy_callback_returns_starlette_middlewares() -> None:
    from ray.serve._private.http_util import validate_http_proxy_callback_return

    classes = [m.cls for m in validate_http_proxy_callback_return(proxy_middlewares())]
    assert StreamEndGuard in classes
