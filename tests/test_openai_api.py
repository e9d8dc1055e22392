"""The OpenAI HTTP layer over the tiny engine: real uvicorn, the official openai client, httpx."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import openai
import pytest
from http_util import ServerThread
from test_engine import make_engine

from dsv3serve.engine.engine import Engine
from dsv3serve.engine.request import Request
from dsv3serve.engine.sampling_params import SamplingParams
from dsv3serve.model.tiny import cached_tiny_checkpoint
from dsv3serve.tokenizer.tokenizer import Tokenizer
from router.openai_api import APIConfig, OpenAIServer, build_fastapi_app
from workers.backend import BackendOverloaded
from workers.local import LocalEngineBackend
from workers.protocol import GenerateRequest, TokenChunk

try:
    import httpx
except ImportError:  # this environment ships the client under its new name
    import httpx2 as httpx  # type: ignore[no-redef]

MAX_MODEL_LEN = 1024
MODEL = "deepseek-v3-tiny"
CHAT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Name three prime numbers."},
]
GREEDY_CHAT = {"temperature": 0, "max_tokens": 12, "extra_body": {"ignore_eos": True}}


@dataclass
class Served:
    """One engine behind one real HTTP server."""

    engine: Engine
    backend: Any
    server: OpenAIServer
    http: ServerThread

    @property
    def url(self) -> str:
        return self.http.url

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key="x", max_retries=0, timeout=60)


def serve(backend_of: Callable[[LocalEngineBackend], Any], **config: Any) -> Iterator[Served]:
    engine = make_engine(max_model_len=MAX_MODEL_LEN)
    backend = backend_of(LocalEngineBackend(engine))
    api = APIConfig(max_model_len=MAX_MODEL_LEN, **config)
    server = OpenAIServer(api, engine.tokenizer, backend)
    with ServerThread(build_fastapi_app(server)) as http:
        yield Served(engine, backend, server, http)


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    yield from serve(lambda b: b)


@pytest.fixture(scope="module")
def client(served: Served) -> openai.OpenAI:
    return served.client()


@pytest.fixture(scope="module")
def offline() -> Engine:
    """A second engine, run offline (no HTTP, no asyncio), for reference outputs."""
    return make_engine(max_model_len=MAX_MODEL_LEN)


def offline_text(engine: Engine, prompt_ids: list[int], params: SamplingParams) -> str:
    texts: list[str] = []
    engine.add_request(Request("ref", params, prompt_ids=prompt_ids))
    while engine.has_unfinished():
        texts += [out.text for out in engine.step()]
    return "".join(texts)


def wait_idle(served: Served, timeout_s: float = 5.0) -> None:
    """Until no sequence is live, no slot is held and every KV page is free."""
    engine, kv = served.engine, served.engine.scheduler.kv
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with served.backend.engine._lock:  # the AsyncEngine steps from another thread
            if not engine.has_unfinished() and served.server.admission.in_flight == 0:
                kv.evict_all()
                if kv.free_pages == kv.num_pages:
                    assert engine.scheduler.num_running + engine.scheduler.num_waiting == 0
                    return
        time.sleep(0.02)
    raise AssertionError(
        f"not idle after {timeout_s} s: unfinished={engine.has_unfinished()}, "
        f"in_flight={served.server.admission.in_flight}, free={kv.free_pages}/{kv.num_pages}"
    )


# ---- behaviour with the official client ------------------------------------------------
def test_models_and_health(served: Served, client: openai.OpenAI) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]
    assert models[0].model_extra["max_model_len"] == MAX_MODEL_LEN
    assert httpx.get(served.url + "/health").status_code == 200


def test_greedy_chat_stream_equals_whole_and_offline(
    served: Served, client: openai.OpenAI, offline: Engine
) -> None:
    whole = client.chat.completions.create(model=MODEL, messages=CHAT, **GREEDY_CHAT)
    stream = client.chat.completions.create(
        model=MODEL,
        messages=CHAT,
        stream=True,
        stream_options={"include_usage": True},
        **GREEDY_CHAT,
    )
    chunks = list(stream)
    prompt_ids = served.engine.tokenizer.encode_chat(CHAT)
    params = SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True)
    expected = offline_text(offline, prompt_ids, params)

    choice = whole.choices[0]
    assert whole.id.startswith("chatcmpl-") and whole.object == "chat.completion"
    assert choice.message.role == "assistant" and choice.message.content == expected
    assert choice.finish_reason == "length"
    assert whole.usage.prompt_tokens == len(prompt_ids)
    assert whole.usage.completion_tokens == 12
    assert whole.usage.total_tokens == len(prompt_ids) + 12

    assert chunks[0].choices[0].delta.role == "assistant"
    assert len({c.id for c in chunks}) == 1 and chunks[0].id != whole.id
    content = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].delta.content or "" for c in content) == expected
    assert [c.choices[0].finish_reason for c in content][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in content[:-1])
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage.prompt_tokens == len(prompt_ids)
    assert usage.completion_tokens == 12 and usage.total_tokens == whole.usage.total_tokens


def test_n2_with_seed_is_reproducible(served: Served, client: openai.OpenAI) -> None:
    kw = {
        "n": 2,
        "temperature": 1.0,
        "seed": 7,
        "max_tokens": 8,
        "extra_body": {"ignore_eos": True},
    }
    first = client.chat.completions.create(model=MODEL, messages=CHAT, **kw)
    again = client.chat.completions.create(model=MODEL, messages=CHAT, **kw)
    streamed = ["", ""]
    for chunk in client.chat.completions.create(model=MODEL, messages=CHAT, stream=True, **kw):
        for choice in chunk.choices:
            streamed[choice.index] += choice.delta.content or ""
    texts = [c.message.content for c in first.choices]
    assert [c.index for c in first.choices] == [0, 1]
    assert texts == [c.message.content for c in again.choices] == streamed
    assert texts[0] != texts[1]
    assert first.usage.completion_tokens == 16
    assert first.usage.prompt_tokens == len(served.engine.tokenizer.encode_chat(CHAT))


def test_chat_logprobs_shapes(client: openai.OpenAI) -> None:
    kw = {"temperature": 0, "max_tokens": 4, "logprobs": True, "top_logprobs": 3}
    whole = client.chat.completions.create(model=MODEL, messages=CHAT, **kw)
    entries = whole.choices[0].logprobs.content
    assert len(entries) == 4
    for entry in entries:
        assert entry.logprob <= 0 and bytes(entry.bytes).decode("utf-8", "replace") == entry.token
        assert len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[-1].logprob
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)  # greedy: the top
    streamed = client.chat.completions.create(model=MODEL, messages=CHAT, stream=True, **kw)
    tokens = [
        e.token
        for c in streamed
        if c.choices and c.choices[0].logprobs
        for e in c.choices[0].logprobs.content
    ]
    assert tokens == [e.token for e in entries]


def test_completion_token_prompt_and_logprobs(served: Served, client: openai.OpenAI) -> None:
    text_prompt = "The capital of France is"
    ids = served.engine.tokenizer.encode(text_prompt, add_bos=True)
    kw = {"temperature": 0, "max_tokens": 5, "logprobs": 2, "extra_body": {"ignore_eos": True}}
    by_ids = client.completions.create(model=MODEL, prompt=ids, **kw)
    by_text = client.completions.create(model=MODEL, prompt=text_prompt, **kw)
    choice = by_ids.choices[0]
    assert by_ids.object == "text_completion" and by_ids.id.startswith("cmpl-")
    assert choice.text == by_text.choices[0].text and choice.finish_reason == "length"
    assert by_ids.usage.prompt_tokens == len(ids) and by_ids.usage.completion_tokens == 5
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert all(1 <= len(top) <= 3 for top in lp.top_logprobs)
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    streamed = client.completions.create(model=MODEL, prompt=ids, stream=True, **kw)
    parts = [c.choices[0] for c in streamed]
    assert "".join(p.text for p in parts) == choice.text
    assert sum((p.logprobs.text_offset for p in parts if p.logprobs), []) == lp.text_offset


def test_stop_strings(client: openai.OpenAI) -> None:
    full = (
        client.chat.completions.create(
            model=MODEL,
            messages=CHAT,
            temperature=0,
            max_tokens=24,
            extra_body={"ignore_eos": True},
        )
        .choices[0]
        .message.content
    )
    stop = full[len(full) // 2 : len(full) // 2 + 2]
    expected = full[: full.index(stop)]
    whole = client.chat.completions.create(
        model=MODEL, messages=CHAT, temperature=0, max_tokens=24, stop=[stop, "\x00never"]
    )
    assert whole.choices[0].message.content == expected
    assert whole.choices[0].finish_reason == "stop"
    stream = client.chat.completions.create(
        model=MODEL, messages=CHAT, temperature=0, max_tokens=24, stop=stop, stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == expected


# ---- bad input ---------------------------------------------------------------------------
CHAT_PATH, COMPLETIONS_PATH = "/v1/chat/completions", "/v1/completions"
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
    ("tool role", *chat(messages=[{"role": "tool", "content": "x"}]), 400, "messages"),
    ("image part", *chat(messages=IMAGE), 400, "messages"),
    ("tools", *chat(tools=[{"type": "function"}]), 400, "tools"),
    ("empty prompt", *comp(prompt=""), 400, "prompt"),
    ("empty id prompt", *comp(prompt=[]), 400, "prompt"),
    ("negative id", *comp(prompt=[1, -2]), 400, "prompt"),
    ("prompt batch", *comp(prompt=["a", "b"]), 400, "prompt"),
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


# ---- admission and disconnects -----------------------------------------------------------
class GatedBackend:
    """A real LocalEngineBackend whose streams wait for ``gate`` before their first chunk.

    The gate is a threading.Event (set from the test thread, polled on the server's loop).
    """

    def __init__(self, inner: LocalEngineBackend) -> None:
        self.inner = inner
        self.engine = inner.engine
        self.gate = threading.Event()
        self.entered = 0

    async def generate(self, req: GenerateRequest) -> AsyncIterator[TokenChunk]:
        self.entered += 1
        while not self.gate.is_set():
            await asyncio.sleep(0.01)
        stream = self.inner.generate(req)
        try:
            async for chunk in stream:
                yield chunk
        finally:
            await stream.aclose()

    async def is_healthy(self) -> bool:
        return True


@pytest.fixture()
def gated() -> Iterator[Served]:
    yield from serve(GatedBackend, max_in_flight=2, retry_after_s=3)


def test_admission_429_fast_then_slots_released(gated: Served) -> None:
    url = gated.url + COMPLETIONS_PATH
    body = {"prompt": "hello", "max_tokens": 4, "temperature": 0}
    with ThreadPoolExecutor(2) as pool:
        admitted = [pool.submit(httpx.post, url, json=body, timeout=30) for _ in range(2)]
        deadline = time.monotonic() + 10
        while gated.backend.entered < 2:
            assert time.monotonic() < deadline, "the two requests were never admitted"
            time.sleep(0.01)
        start = time.monotonic()
        refused = httpx.post(url, json=body, timeout=10)
        assert time.monotonic() - start < 1.0
        assert refused.status_code == 429 and refused.headers["retry-after"] == "3"
        assert refused.json()["error"]["type"] == "rate_limit_exceeded"
        gated.backend.gate.set()
        assert [f.result().status_code for f in admitted] == [200, 200]
    assert gated.server.admission.in_flight == 0
    assert gated.client().completions.create(model=MODEL, prompt="hi", max_tokens=2).choices
    wait_idle(gated)


@pytest.mark.parametrize("stream", [True, False])
def test_client_disconnect_aborts_and_frees_everything(served: Served, stream: bool) -> None:
    body = {"messages": CHAT, "max_tokens": 900, "ignore_eos": True, "stream": stream}
    url = served.url + CHAT_PATH
    if stream:
        with httpx.stream("POST", url, json=body, timeout=30) as response:
            events = (line for line in response.iter_lines() if line.startswith("data: "))
            assert [next(events) for _ in range(3)]
    else:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(url, json=body, timeout=0.5)
    wait_idle(served)  # 900 tokens would take far longer than 5 s to finish by themselves


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
