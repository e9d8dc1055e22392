"""Hostile input to the OpenAI API on a real engine over real HTTP: always a 4xx with an
OpenAI error body, never a 5xx or a hang; the server stays healthy.

A table of every bad input from issue 21, a slow body (408, connection closed), the
``abort`` finish reason counted when a client goes away, and a schema-based fuzz run
over the request models (hypothesis, loopback only, a bounded number of examples).
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from engine_util import make_engine
from http_util import ServerThread
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from openai_api_util import CHAT_PATH, COMPLETIONS_PATH, MAX_MODEL_LEN, MODEL, Served, wait_idle
from request_fuzz import any_json, deep_json, request_bodies

from dsv3serve.metrics import Identity, Metrics
from router.api.openai_api import APIConfig, OpenAIServer, build_fastapi_app
from router.api.openai_protocol import ChatCompletionRequest, CompletionRequest
from router.metered import MeteredBackend
from workers.local import LocalEngineBackend

BODY_TIMEOUT_S = 1.0
MSG = [{"role": "user", "content": "hi"}]
INTERNAL_NAMES = ("max_new_tokens", "min_new_tokens", "SamplingParams")


@dataclass
class Hardened(Served):
    """The served engine, with the router's metrics around its backend."""

    metrics: Metrics | None = None


@pytest.fixture(scope="module")
def hardened() -> Iterator[Hardened]:
    engine = make_engine(max_model_len=MAX_MODEL_LEN)
    local = LocalEngineBackend(engine)
    metrics = Metrics(Identity("router", "router", MODEL))
    api = APIConfig(
        max_model_len=MAX_MODEL_LEN,
        body_read_timeout_s=BODY_TIMEOUT_S,
        vocab_size=engine.model_cfg.vocab_size,
    )
    server = OpenAIServer(api, engine.tokenizer, MeteredBackend(local, metrics))
    with ServerThread(build_fastapi_app(server)) as http:
        yield Hardened(engine, local, server, http, metrics)


def post(url: str, body: Any) -> httpx.Response:
    """POST ``body`` (bytes as they are; else JSON with ASCII escapes, so lone
    surrogates travel as ``\\ud800``)."""
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    return httpx.post(url, content=content, headers=headers, timeout=60)


def nested(depth: int) -> bytes:
    """``{"messages": [...], "ignored": [[[...]]]}`` nested ``depth`` deep in a field
    the server ignores."""
    inner = b"[" * depth + b"]" * depth
    head = b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "ignored": '
    return head + inner + b"}"


def chat(**fields: Any) -> tuple[str, dict[str, Any]]:
    return CHAT_PATH, {"messages": MSG, "max_tokens": 2} | fields


def comp(**fields: Any) -> tuple[str, dict[str, Any]]:
    return COMPLETIONS_PATH, {"prompt": "hi", "max_tokens": 2} | fields


VOCAB = 129280  # the tiny model's vocabulary (and the tokenizer's ids are below it)
NINES = b"9" * 5000  # past Python's 4300-digit limit on int parsing
SURROGATE = [{"role": "user", "content": "a\ud800b"}]
BAD_INPUTS: list[tuple[Any, ...]] = [  # name, path, body, status, param
    ("seed 2**64-1 with n=2", *chat(seed=2**64 - 1, n=2), 400, "seed"),
    ("seed 2**70", *comp(seed=2**70), 400, "seed"),
    ("seed below int64", *comp(seed=-(2**63) - 1), 400, "seed"),
    ("n as string", *chat(n="2"), 400, "n"),
    ("n 2**70", *chat(n=2**70), 400, "n"),
    ("stream as string", *chat(stream="yes"), 400, "stream"),
    ("ignore_eos as int", *comp(ignore_eos=1), 400, "ignore_eos"),
    ("temperature as string", *comp(temperature="0.5"), 400, "temperature"),
    ("max_tokens as float", *comp(max_tokens=2.0), 400, "max_tokens"),
    ("max_tokens as bool", *comp(max_tokens=True), 400, "max_tokens"),
    ("max_tokens 2**70", *comp(max_tokens=2**70), 400, "max_tokens"),
    ("min_tokens 2**70", *comp(min_tokens=2**70), 400, "min_tokens"),
    ("top_logprobs 2**70", *chat(logprobs=True, top_logprobs=2**70), 400, "top_logprobs"),
    ("logprobs as bool", *comp(logprobs=True), 400, "logprobs"),
    ("top_k -2", *comp(top_k=-2), 400, "top_k"),
    ("prompt id = vocab", *comp(prompt=[1, VOCAB]), 400, "prompt"),
    ("prompt id 2**70", *comp(prompt=[2**70]), 400, "prompt"),
    ("prompt id as bool", *comp(prompt=[True]), 400, "prompt"),
    ("stop_token_ids over vocab", *comp(stop_token_ids=[VOCAB + 5]), 400, "stop_token_ids"),
    ("lone surrogate in content", *chat(messages=SURROGATE), 400, None),
    ("lone surrogate in model", *chat(model="x\udc00"), 400, None),
    ("lone surrogate in stop", *comp(stop=["\ud83d"]), 400, None),
    ("depth 5000 in ignored field", CHAT_PATH, nested(5000), 400, None),
    ("depth 100000 in ignored field", CHAT_PATH, nested(100_000), 400, None),
    ("depth 129", CHAT_PATH, nested(128), 400, None),  # 128 in the field, 1 around it
    (
        "integer of 5000 digits",
        COMPLETIONS_PATH,
        b'{"prompt": "hi", "n": ' + NINES + b"}",
        400,
        None,
    ),
    (
        "NaN temperature",
        COMPLETIONS_PATH,
        b'{"prompt": "hi", "temperature": NaN}',
        400,
        "temperature",
    ),
    (
        "temperature 1e999",
        COMPLETIONS_PATH,
        b'{"prompt": "hi", "temperature": 1e999}',
        400,
        "temperature",
    ),
    ("min over max names max_tokens", *comp(max_tokens=2, min_tokens=3), 400, "min_tokens"),
    ("empty regex", *comp(regex=""), 400, "regex"),  # found by the fuzz run below
    ("blank ebnf", *comp(ebnf="  "), 400, "ebnf"),
    ("trailing slash chat", CHAT_PATH + "/", {"messages": MSG}, 404, None),
    ("trailing slash completions", COMPLETIONS_PATH + "/", {"prompt": "hi"}, 404, None),
]


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [case[1:] for case in BAD_INPUTS],
    ids=[case[0] for case in BAD_INPUTS],
)
def test_bad_input_gets_a_4xx_openai_error(
    hardened: Hardened, path: str, body: Any, status: int, param: str | None
) -> None:
    response = post(hardened.url + path, body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error
    assert not any(name in error["message"] for name in INTERNAL_NAMES), error["message"]


def test_error_message_names_request_fields(hardened: Hardened) -> None:
    message = post(hardened.url + COMPLETIONS_PATH, comp(max_tokens=2, min_tokens=3)[1])
    assert "min_tokens (3) must be <= max_tokens (2)" in message.json()["error"]["message"]


def test_nesting_within_the_limit_is_accepted(hardened: Hardened) -> None:
    response = post(hardened.url + CHAT_PATH, nested(120))
    assert response.status_code == 200, response.text


def test_huge_top_k_and_extreme_seeds_are_served(hardened: Hardened) -> None:
    """top_k past the vocabulary means no top-k; seeds at both ends of int64 sample."""
    for fields in ({"top_k": 2**70}, {"seed": 2**63 - 1, "n": 2}, {"seed": -(2**63)}):
        response = post(hardened.url + COMPLETIONS_PATH, comp(**fields)[1])
        assert response.status_code == 200, (fields, response.text)


def test_get_on_a_post_route_is_405_with_an_error_body(hardened: Hardened) -> None:
    response = httpx.get(hardened.url + CHAT_PATH, timeout=10)
    assert response.status_code == 405
    assert "GET /v1/chat/completions" in response.json()["error"]["message"]


def test_slow_body_gets_408_and_the_connection_is_closed(hardened: Hardened) -> None:
    """11 of 100 declared bytes, then nothing: 408 after the body timeout, then EOF."""
    head = (
        f"POST {COMPLETIONS_PATH} HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        "Content-Type: application/json\r\nContent-Length: 100\r\n\r\n"
    )
    with socket.create_connection((hardened.http.host, hardened.http.port)) as sock:
        sock.settimeout(30)  # a guard against a hang, not a measurement
        sock.sendall(head.encode() + b'{"prompt": ')
        received = b""
        while chunk := sock.recv(65536):  # until the server closes the connection
            received += chunk
    status_line, _, rest = received.partition(b"\r\n")
    assert status_line == b"HTTP/1.1 408 Request Timeout", received
    error = json.loads(rest.partition(b"\r\n\r\n")[2])["error"]
    assert error["code"] == "request_timeout" and "1 s" in error["message"]


def aborted(metrics: Metrics) -> float:
    """``request_success_total{finished_reason="abort"}``."""
    return sum(
        sample.value
        for family in metrics.registry.collect()
        for sample in family.samples
        if sample.name.endswith("request_success_total")
        and sample.labels.get("finished_reason") == "abort"
    )


def test_client_gone_mid_stream_counts_abort(hardened: Hardened) -> None:
    assert hardened.metrics is not None
    before = aborted(hardened.metrics)
    client = hardened.client()
    stream = client.completions.create(
        model=MODEL, prompt="hi", max_tokens=900, stream=True, extra_body={"ignore_eos": True}
    )
    next(iter(stream))
    stream.close()
    deadline = time.monotonic() + 30  # the server notices the disconnect on its own time
    while aborted(hardened.metrics) == before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert aborted(hardened.metrics) == before + 1
    wait_idle(hardened, timeout_s=30)


# ---- schema-based fuzzing -------------------------------------------------------------
FUZZ = settings(
    max_examples=80,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


def assert_answered_without_5xx(response: httpx.Response) -> None:
    assert response.status_code < 500, response.text
    if response.status_code >= 400:
        error = response.json()["error"]
        assert error["message"] and error["type"] != "internal_error", error
    elif response.headers["content-type"].startswith("text/event-stream"):
        assert "internal_error" not in response.text and "data: [DONE]" in response.text


@FUZZ
@given(body=request_bodies(ChatCompletionRequest.model_json_schema(), MODEL))
def test_fuzzed_chat_bodies_never_get_5xx(hardened: Hardened, body: dict[str, Any]) -> None:
    assert_answered_without_5xx(post(hardened.url + CHAT_PATH, body))


@FUZZ
@given(body=request_bodies(CompletionRequest.model_json_schema(), MODEL))
def test_fuzzed_completion_bodies_never_get_5xx(hardened: Hardened, body: dict[str, Any]) -> None:
    assert_answered_without_5xx(post(hardened.url + COMPLETIONS_PATH, body))


@FUZZ
@given(
    body=st.one_of(
        st.binary(max_size=64), deep_json(), any_json(40).map(lambda v: json.dumps(v).encode())
    )
)
def test_fuzzed_raw_bodies_never_get_5xx(hardened: Hardened, body: bytes) -> None:
    assert_answered_without_5xx(post(hardened.url + CHAT_PATH, body))


def test_healthy_and_idle_after_everything(hardened: Hardened) -> None:
    assert httpx.get(hardened.url + "/health", timeout=10).status_code == 200
    client = hardened.client()
    out = client.completions.create(model=MODEL, prompt="hello", max_tokens=3, temperature=0)
    assert out.usage.completion_tokens >= 1
    wait_idle(hardened, timeout_s=30)
