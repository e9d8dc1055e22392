"""The OpenAI API's errors: bad input, and backend failures as OpenAI error bodies."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

import openai
import pytest
from http_util import ServerThread

from dsv3serve.model.tiny import cached_tiny_checkpoint
from dsv3serve.tokenizer.tokenizer import Tokenizer
from router.api.openai_api import APIConfig, OpenAIServer, build_fastapi_app
from workers.backend import BackendOverloaded
from workers.protocol import GenerateRequest, TokenChunk

try:
    import httpx
except ImportError:  # this environment ships the client under its new name
    import httpx2 as httpx  # type: ignore[no-redef]
from openai_api_util import (
    CHAT_PATH,
    COMPLETIONS_PATH,
    MAX_MODEL_LEN,
    MODEL,
    Served,
    client_fixture,  # noqa: F401 (fixture client)
    served_fixture,  # noqa: F401 (fixture served)
    wait_idle,
)

MSG = [{"role": "user", "content": "hi"}]
TOO_LONG = list(range(1000, 1000 + MAX_MODEL_LEN + 10))
IMAGE = [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]
HUGE = b'{"prompt": "' + b"a" * (1 << 20) + b'"}'


def chat(**fields: Any) -> tuple[str, dict[str, Any]]:
    return CHAT_PATH, {"messages": MSG} | fields


def comp(**fields: Any) -> tuple[str, dict[str, Any]]:
    return COMPLETIONS_PATH, {"prompt": "hi"} | fields


BAD_INPUTS: list[tuple[Any, ...]] = [
    ("bad json", CHAT_PATH, b'{"messages": [', 400, None),
    ("invalid utf-8", COMPLETIONS_PATH, b'{"prompt": "\xff\xfe"}', 400, None),
    ("not an object", CHAT_PATH, b"[1, 2]", 400, None),
    ("messages as string", *chat(messages="hi"), 400, "messages"),
    ("missing messages", CHAT_PATH, {"model": MODEL}, 400, "messages"),
    ("max_tokens ten", *chat(max_tokens="ten"), 400, "max_tokens"),
    ("temperature -1", *chat(temperature=-1), 400, "temperature"),
    ("top_p 2", *chat(top_p=2), 400, "top_p"),
    ("n 0", *chat(n=0), 400, "n"),
    ("n over max_n", *chat(n=17), 400, "n"),
    ("logprobs 50", *comp(logprobs=50), 400, "logprobs"),
    ("top_logprobs 50", *chat(logprobs=True, top_logprobs=50), 400, "top_logprobs"),
    ("max_tokens 0", *comp(max_tokens=0), 400, "max_tokens"),
    ("min_tokens over max", *comp(max_tokens=2, min_tokens=3), 400, "min_tokens"),
    ("stop not str", *comp(stop=5), 400, "stop"),
    ("prompt too long", *comp(prompt=TOO_LONG), 400, "prompt"),
    ("prompt + max_tokens too long", *comp(max_tokens=MAX_MODEL_LEN), 400, "max_tokens"),
    ("chat too long", *chat(max_completion_tokens=MAX_MODEL_LEN), 400, "max_completion_tokens"),
    ("empty messages", *chat(messages=[]), 400, "messages"),
    ("function role", *chat(messages=[{"role": "function", "content": "x"}]), 400, "messages"),
    ("tool without content", *chat(messages=[{"role": "tool"}]), 400, "messages"),
    ("image part", *chat(messages=IMAGE), 400, "messages"),
    ("tools", *chat(tools=[{"type": "function"}]), 400, "tools"),
    ("empty prompt", *comp(prompt=""), 400, "prompt"),
    ("empty id prompt", *comp(prompt=[]), 400, "prompt"),
    ("negative id", *comp(prompt=[1, -2]), 400, "prompt"),
    ("empty prompt in a batch", *comp(prompt=["a", ""]), 400, "prompt"),
    ("streamed batch", *comp(prompt=["a", "b"], stream=True), 400, "stream"),
    ("stream_options alone", *chat(stream_options={"include_usage": True}), 400, "stream_options"),
    ("unknown model", *chat(model="gpt-4"), 404, "model"),
    ("body too large", COMPLETIONS_PATH, HUGE, 413, None),
    ("unknown route", "/v1/embeddings", {"input": "x"}, 404, None),
]


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [case[1:] for case in BAD_INPUTS],
    ids=[case[0] for case in BAD_INPUTS],
)
def test_bad_input_gets_openai_error(
    served: Served, path: str, body: Any, status: int, param: str | None
) -> None:
    kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
    headers = {"Content-Type": "application/json"}
    response = httpx.post(served.url + path, headers=headers, timeout=10, **kwargs)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["param"] == param, error
    expected_type = "NotFoundError" if param == "model" else "invalid_request_error"
    assert error["type"] == expected_type


def test_chunked_body_over_limit_is_413(served: Served) -> None:
    def body() -> Iterator[bytes]:
        yield b'{"prompt": "'
        for _ in range(20):
            yield b"a" * 65536
        yield b'"}'

    response = httpx.post(served.url + COMPLETIONS_PATH, content=body(), timeout=10)
    assert response.status_code == 413 and response.json()["error"]["code"] == "request_too_large"


def test_healthy_and_serving_after_bad_inputs(served: Served, client: openai.OpenAI) -> None:
    assert httpx.get(served.url + "/health").status_code == 200
    out = client.completions.create(model=MODEL, prompt="hello", max_tokens=3, temperature=0)
    assert out.usage.completion_tokens >= 1
    wait_idle(served)


# ---- backend failures (a fake: the real engine cannot be made to fail on demand) ---------
class FailingBackendFake:
    """Answers "Hi!" in two chunks, or fails the way ``mode`` says."""

    def __init__(self) -> None:
        self.mode = "ok"
        self.healthy = True
        self.request_ids: list[str] = []

    async def generate(self, req: GenerateRequest) -> AsyncIterator[TokenChunk]:
        self.request_ids.append(req.request_id)
        rid, n_prompt = req.request_id, len(req.prompt_ids)
        if self.mode == "overloaded":
            raise BackendOverloaded("every replica is full")
        if self.mode == "crash":
            raise RuntimeError("boom")
        if self.mode == "rejected":
            yield TokenChunk(request_id=rid, finished=True, error="too long", error_status=400)
            return
        yield TokenChunk(request_id=rid, token_ids=[1000], text="Hi", completion_tokens=1)
        if self.mode == "dies":
            yield TokenChunk(request_id=rid, finished=True, error="replica died", error_status=503)
        elif self.mode == "crash_later":
            raise RuntimeError("boom later")
        else:
            last = {"finished": True, "finish_reason": "stop", "prompt_tokens": n_prompt}
            yield TokenChunk(request_id=rid, token_ids=[0], text="!", completion_tokens=2, **last)

    async def is_healthy(self) -> bool:
        return self.healthy


@dataclass
class Faked:
    backend: FailingBackendFake
    server: OpenAIServer
    http: ServerThread


@pytest.fixture(scope="module")
def faked() -> Iterator[Faked]:
    backend = FailingBackendFake()
    tokenizer = Tokenizer.from_dir(cached_tiny_checkpoint())
    server = OpenAIServer(APIConfig(max_model_len=MAX_MODEL_LEN), tokenizer, backend)
    with ServerThread(build_fastapi_app(server)) as http:
        yield Faked(backend, server, http)


FAILURES = [  # mode, stream, HTTP status, error type (in-band when the status is 200)
    ("overloaded", False, 429, "rate_limit_exceeded"),
    ("overloaded", True, 429, "rate_limit_exceeded"),
    ("crash", False, 500, "internal_error"),
    ("crash", True, 500, "internal_error"),
    ("rejected", True, 400, "invalid_request_error"),
    ("dies", False, 503, "internal_error"),
    ("crash_later", False, 500, "internal_error"),
    ("dies", True, 200, "internal_error"),
    ("crash_later", True, 200, "internal_error"),
]


@pytest.mark.parametrize(("mode", "stream", "status", "error_type"), FAILURES)
def test_backend_failures_become_openai_errors(
    faked: Faked, mode: str, stream: bool, status: int, error_type: str
) -> None:
    faked.backend.mode = mode
    body = {"prompt": "hi", "stream": stream}
    response = httpx.post(faked.http.url + COMPLETIONS_PATH, json=body, timeout=10)
    assert response.status_code == status, response.text
    if status == 200:
        events = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
        assert json.loads(events[0])["choices"][0]["text"] == "Hi" and events[-1] == "[DONE]"
        assert json.loads(events[-2])["error"]["type"] == error_type
    else:
        assert response.json()["error"]["type"] == error_type
    if status == 429:
        assert response.headers["retry-after"] == "1"
    assert faked.server.admission.in_flight == 0


def test_fake_server_ids_health_and_client_errors(faked: Faked) -> None:
    faked.backend.mode = "ok"
    body = {"prompt": "hi", "id": "mine", "request_id": "mine", "unknown_field": 1}
    out = httpx.post(faked.http.url + COMPLETIONS_PATH, json=body, timeout=10).json()
    assert out["id"].startswith("cmpl-") and out["id"] == faked.backend.request_ids[-1]
    choice = out["choices"][0]
    assert choice == {"index": 0, "text": "Hi!", "logprobs": None, "finish_reason": "stop"}
    client = openai.OpenAI(base_url=faked.http.url + "/v1", api_key="x", max_retries=0)
    faked.backend.mode = "dies"
    with pytest.raises(openai.APIError, match="replica died"):
        list(client.completions.create(model=MODEL, prompt="hi", stream=True))
    faked.backend.healthy = False
    assert httpx.get(faked.http.url + "/health").status_code == 503
    faked.backend.healthy = True
