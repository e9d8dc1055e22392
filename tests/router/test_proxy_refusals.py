"""router/api/proxy_refusals.py on its own: the messages are the ones Serve's proxy builds
for its own refusals (``ray.serve._private.http_util``: a backpressure 429, an unavailable
deployment's 503, a time-out's 408), played through the middleware; a real proxy refusing
is in tests/e2e/test_proxy_refusals_live.py."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence

import pytest
from ray.serve._private.common import DeploymentID
from ray.serve._private.http_util import (
    get_http_response_status,
    send_http_response_on_exception,
)
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError
from starlette.types import Message, Receive, Scope, Send

from router.api.proxy_middleware import proxy_middlewares
from router.api.proxy_refusals import RATE_LIMITED, TIMED_OUT, UNAVAILABLE, RefusalBody


class PlaybackProxyApp:
    """Stands in for Serve's proxy: sends ``messages`` in order."""

    def __init__(self, messages: Sequence[Message]) -> None:
        self.messages = list(messages)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        for message in self.messages:
            await send(message)


def serve_refusal(exc: BaseException) -> list[Message]:
    """What Serve's proxy sends when routing a request raised ``exc``."""
    status = get_http_response_status(exc, request_timeout_s=30.0, request_id="r-1")
    return send_http_response_on_exception(status, response_started=False)


def through_middleware(messages: Sequence[Message]) -> list[Message]:
    sent: list[Message] = []

    async def send(message: Message) -> None:
        sent.append(message)

    async def receive() -> Message:
        return {"type": "http.request", "body": b"", "more_body": False}

    scope: Scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions"}
    asyncio.run(RefusalBody(PlaybackProxyApp(messages))(scope, receive, send))
    return sent


def head_and_json(sent: list[Message]) -> tuple[int, dict[bytes, bytes], dict]:
    start, *bodies = sent
    assert start["type"] == "http.response.start"
    assert [b["more_body"] for b in bodies] == [False], "one final body message"
    headers = {bytes(k).lower(): bytes(v) for k, v in start["headers"]}
    assert headers[b"content-length"] == str(len(bodies[0]["body"])).encode()
    return start["status"], headers, json.loads(bodies[0]["body"])


@pytest.mark.parametrize(
    ("exc", "status", "code"),
    [
        (BackPressureError(8, 8, status_code=429, retry_after_s=1.0), 429, RATE_LIMITED),
        (DeploymentUnavailableError(DeploymentID("router", "app")), 503, UNAVAILABLE),
        (TimeoutError(), 408, TIMED_OUT),
    ],
)
def test_the_proxys_plain_text_refusals_get_openai_bodies(
    exc: BaseException, status: int, code: str
) -> None:
    messages = serve_refusal(exc)
    assert b"text/plain" in dict(messages[0]["headers"])[b"content-type"]  # Serve's own
    got_status, headers, body = head_and_json(through_middleware(messages))
    assert got_status == status and headers[b"content-type"] == b"application/json"
    assert headers[b"retry-after"] == b"1"  # Serve's on the 429, ours on the others
    error = body["error"]
    assert error["code"] == error["type"] == code and error["param"] is None
    assert "num_queued_requests" not in error["message"], "Serve's internals leaked"


def test_a_routers_own_json_429_and_other_responses_pass_untouched() -> None:
    own = [
        {"type": "http.response.start", "status": 429,
         "headers": [(b"content-type", b"application/json"), (b"retry-after", b"2")]},
        {"type": "http.response.body", "body": b'{"error": {}}', "more_body": False},
    ]  # fmt: skip
    assert through_middleware(own) == own
    metrics = [
        {"type": "http.response.start", "status": 200,
         "headers": [(b"content-type", b"text/plain; version=0.0.4")]},
        {"type": "http.response.body", "body": b"a 1\n", "more_body": True},
        {"type": "http.response.body", "body": b"", "more_body": False},
    ]  # fmt: skip
    assert through_middleware(metrics) == metrics


def test_a_refusal_in_several_body_messages_becomes_one_json_body() -> None:
    start, body = serve_refusal(BackPressureError(1, 1, status_code=429))
    split = [start, {**body, "more_body": True}, {**body, "body": b"", "more_body": False}]
    status, _, payload = head_and_json(through_middleware(split))
    assert status == 429 and payload["error"]["code"] == RATE_LIMITED


def test_the_proxy_callback_installs_it() -> None:
    assert RefusalBody in [m.cls for m in proxy_middlewares()]
