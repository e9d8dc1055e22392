"""The PD and colocated apps on a real local Ray cluster, called over real HTTP.

Router, prefill, KV transfer (shared memory) and decode all run as Ray Serve replicas;
requests come from the official ``openai`` client and raw ``httpx``.
"""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import Iterator

import httpx
import openai
import pytest
from schema_cases import invalid_outputs
from serving_util import (
    TINY_ENGINE,
    ServeCluster,
    holds_nothing,
    running_app,
    serving_config,
    wait_until,
    worker_stats,
)

from dsv3serve.engine.config import EngineConfig
from dsv3serve.engine.engine import Engine
from dsv3serve.engine.request import Request
from dsv3serve.sampling.sampling_params import SamplingParams
from router.pd.prefill_watch import PrefillStalled, prefill_failure

MESSAGES = [{"role": "user", "content": "Tell me about the sea, in detail."}]
PD, COLOCATED, PD_TORCH_DIST = "pd", "colo", "pdtd"
PD_WORKERS = ("prefill-0", "decode-0")
BODY_TIMEOUT_S = 3
# The PD app splits reasoning in thinking mode (deepseek-v3: nothing changes without it).
PD_ROUTER = {
    "served_model_name": "tiny",
    "metrics_port": None,
    "reasoning_parser": "deepseek-v3",
    "body_read_timeout_s": BODY_TIMEOUT_S,
}


@pytest.fixture(scope="module")
def apps(serve_cluster: ServeCluster) -> Iterator[dict[str, str]]:
    with (
        running_app(serve_cluster.base, PD, serving_config(mode="pd", router=PD_ROUTER)) as pd_url,
        running_app(serve_cluster.base, COLOCATED, serving_config(mode="colocated")) as colo_url,
        running_app(
            serve_cluster.base, PD_TORCH_DIST, serving_config(mode="pd", kv_connector="torch_dist")
        ) as td_url,
    ):
        yield {PD: pd_url, COLOCATED: colo_url, PD_TORCH_DIST: td_url}


@pytest.fixture(scope="module")
def offline() -> Engine:
    return Engine(EngineConfig(**TINY_ENGINE))


def offline_greedy_text(engine: Engine, max_tokens: int, thinking: bool | None = None) -> str:
    ids = engine.tokenizer.encode_chat(MESSAGES, True, thinking=thinking)
    params = SamplingParams(temperature=0, max_new_tokens=max_tokens)
    engine.add_request(Request("offline", params, prompt_ids=ids))
    text = ""
    while engine.has_unfinished():
        text += "".join(out.text for out in engine.step())
    return text


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)


@pytest.mark.parametrize("app", [PD, COLOCATED, PD_TORCH_DIST])
def test_streamed_greedy_chat_equals_offline_engine(
    apps: dict[str, str], offline: Engine, app: str
) -> None:
    stream = client(apps[app]).chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=24, temperature=0, stream=True
    )
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert text == offline_greedy_text(offline, 24)


def test_pd_reasoning_content_and_tokens_in_thinking_mode(
    apps: dict[str, str], offline: Engine
) -> None:
    """Through PD (the first token from prefill, the rest from decode), a thinking prompt's
    output is reasoning: the random tiny model never closes </think>."""
    kw = {"model": "tiny", "messages": MESSAGES, "max_tokens": 16, "temperature": 0}
    kw |= {"extra_body": {"chat_template_kwargs": {"thinking": True}, "ignore_eos": True}}
    expected = offline_greedy_text(offline, 16, thinking=True)
    whole = client(apps[PD]).chat.completions.create(**kw)
    message = whole.choices[0].message
    assert message.model_extra["reasoning_content"] == expected and message.content is None
    details = whole.usage.completion_tokens_details
    assert details.reasoning_tokens == whole.usage.completion_tokens == 16
    stream = client(apps[PD]).chat.completions.create(
        stream=True, stream_options={"include_usage": True}, **kw
    )
    chunks = list(stream)
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas) == expected
    assert "".join(d.content or "" for d in deltas) == ""
    assert chunks[-1].usage.completion_tokens_details.reasoning_tokens == 16


def test_pd_non_streaming_usage_n_and_logprobs(apps: dict[str, str], offline: Engine) -> None:
    reply = client(apps[PD]).chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        max_tokens=8,
        temperature=0,
        n=2,
        logprobs=True,
        top_logprobs=2,
    )
    prompt_len = len(offline.tokenizer.encode_chat(MESSAGES, True))
    assert reply.usage.prompt_tokens == prompt_len
    assert reply.usage.completion_tokens == 16
    greedy = offline_greedy_text(offline, 8)
    assert [c.message.content for c in reply.choices] == [greedy, greedy]
    for choice in reply.choices:
        assert len(choice.logprobs.content) == 8
        first = choice.logprobs.content[0]  # sampled on the prefill side, carried over
        assert first.logprob <= 0 and len(first.top_logprobs) == 2
        assert first.top_logprobs[0].logprob >= first.top_logprobs[1].logprob


def test_pd_pages_return_after_requests(apps: dict[str, str]) -> None:
    client(apps[PD]).completions.create(model="tiny", prompt="The sea", max_tokens=4)
    assert all(wait_until(lambda w=w: holds_nothing(worker_stats(PD, w)), 5) for w in PD_WORKERS)


def test_disconnect_mid_stream_frees_pages_on_both_workers(apps: dict[str, str]) -> None:
    body = {
        "model": "tiny",
        "messages": MESSAGES,
        "max_tokens": 4000,
        "stream": True,
        "ignore_eos": True,
    }
    url = f"{apps[PD]}/v1/chat/completions"
    with httpx.Client(timeout=30) as http, http.stream("POST", url, json=body) as response:
        assert response.status_code == 200
        events = 0
        for line in response.iter_lines():
            events += line.startswith("data: ")
            if events == 3:  # still reading: the request is generating on decode
                busy = worker_stats(PD, "decode-0")
                assert busy.live_requests == 1 and busy.free_pages < busy.num_pages
                break
    assert all(wait_until(lambda w=w: holds_nothing(worker_stats(PD, w)), 5) for w in PD_WORKERS)


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        (b"{not json", 400, None),
        (b"\xff\xfe{}", 400, None),
        ({"model": "tiny", "messages": "hi"}, 400, "messages"),
        ({"model": "tiny", "messages": []}, 400, "messages"),
        ({"model": "tiny", "messages": MESSAGES, "temperature": -1}, 400, "temperature"),
        ({"model": "tiny", "messages": MESSAGES, "max_tokens": "ten"}, 400, "max_tokens"),
        ({"model": "tiny", "messages": MESSAGES, "max_tokens": 10**9}, 400, "max_tokens"),
        ({"model": "tiny", "messages": [{"role": "user", "content": "x" * 2_000_000}]}, 413, None),
    ],
)
def test_pd_bad_input_gets_openai_4xx(
    apps: dict[str, str], body: object, status: int, param: str | None
) -> None:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    response = httpx.post(
        f"{apps[PD]}/v1/chat/completions",
        content=content,
        headers={"Content-Type": "application/json"},
        timeout=30,
    )
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["message"] and error["type"]
    if param is not None:
        assert error["param"] == param
    assert httpx.get(f"{apps[PD]}/health", timeout=10).status_code == 200


def test_models_reports_the_kv_pool_and_a_longer_prompt_gets_400_at_once(
    apps: dict[str, str],
) -> None:
    """8,192 KV tokens per replica, far below the model's context: that is the limit, and
    a 50k-token prompt is refused before any replica is asked (not a 429 after a wait)."""
    card = httpx.get(f"{apps[PD]}/v1/models", timeout=30).json()["data"][0]
    assert card["max_model_len"] == TINY_ENGINE["num_kv_tokens"]
    body = {"model": "tiny", "messages": [{"role": "user", "content": "sea " * 50_000}]}
    response = httpx.post(f"{apps[PD]}/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["code"], error["param"]) == ("context_length_exceeded", "messages")
    assert "maximum context length is 8192 tokens" in error["message"]
    assert all(holds_nothing(worker_stats(PD, w)) for w in PD_WORKERS)


def test_serve_proxy_answers_a_trailing_slash_with_404(apps: dict[str, str]) -> None:
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 2}
    response = httpx.post(f"{apps[PD]}/v1/chat/completions/", json=body, timeout=30)
    assert response.status_code == 404, response.text
    assert "/v1/chat/completions/" in response.json()["error"]["message"]


def response_body(raw: bytes) -> bytes:
    """The body of one raw HTTP/1.1 response, chunked or not."""
    head, _, body = raw.partition(b"\r\n\r\n")
    if b"transfer-encoding: chunked" not in head.lower():
        return body
    out = b""
    while body:
        size, _, rest = body.partition(b"\r\n")
        n = int(size, 16)
        out, body = out + rest[:n], rest[n + 2 :]
        if n == 0:
            break
    return out


def test_serve_proxy_closes_a_slow_body_with_408(apps: dict[str, str]) -> None:
    """11 of 100 declared bytes through Serve's proxy: the router's body timeout answers
    408 and the proxy closes the connection."""
    url = httpx.URL(apps[PD])
    head = (
        f"POST {url.path}/v1/completions HTTP/1.1\r\nHost: {url.host}\r\n"
        "Content-Type: application/json\r\nContent-Length: 100\r\n\r\n"
    )
    with socket.create_connection((url.host, url.port)) as sock:
        sock.settimeout(60)  # a guard against a hang, not a measurement
        sock.sendall(head.encode() + b'{"prompt": ')
        received = b""
        while chunk := sock.recv(65536):  # until the proxy closes the connection
            received += chunk
    assert received.startswith(b"HTTP/1.1 408 "), received
    error = json.loads(response_body(received))["error"]
    assert error["code"] == "request_timeout" and f"{BODY_TIMEOUT_S} s" in error["message"]
    assert httpx.get(f"{apps[PD]}/health", timeout=10).status_code == 200


def test_200_concurrent_streams_complete_without_leaks(apps: dict[str, str]) -> None:
    async def one(c: openai.AsyncOpenAI, i: int) -> str:
        stream = await c.chat.completions.create(
            model="tiny",
            max_tokens=6,
            temperature=0.7,
            seed=i,
            stream=True,
            messages=[{"role": "user", "content": f"Request number {i} says hello."}],
        )
        reason = None
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].finish_reason:
                reason = chunk.choices[0].finish_reason
        return reason or "missing"

    async def run_all() -> list[str]:
        c = openai.AsyncOpenAI(
            base_url=f"{apps[PD]}/v1", api_key="none", max_retries=0, timeout=300
        )
        return await asyncio.gather(*(one(c, i) for i in range(200)))

    reasons = asyncio.run(run_all())
    assert len(reasons) == 200 and set(reasons) <= {"stop", "length"}, reasons
    assert all(wait_until(lambda w=w: holds_nothing(worker_stats(PD, w)), 10) for w in PD_WORKERS)


def test_json_schema_outputs_validate_through_pd(apps: dict[str, str]) -> None:
    """The prefill side samples the first token under the schema; decode continues the
    grammar from it (5 samples of each of the 20 schemas, temperature 1)."""
    assert invalid_outputs(f"{apps[PD]}/v1", "tiny", 5) == []
    assert all(wait_until(lambda w=w: holds_nothing(worker_stats(PD, w)), 5) for w in PD_WORKERS)


@pytest.mark.parametrize("app", [PD, COLOCATED])
def test_logit_bias_bans_and_forces_tokens(apps: dict[str, str], offline: Engine, app: str) -> None:
    tok = offline.tokenizer
    kw = {"model": "tiny", "prompt": "The sea", "max_tokens": 4, "temperature": 0}
    http = client(apps[app])
    greedy = http.completions.create(**kw).choices[0].text
    first = tok.encode(greedy, add_bos=False)[0]
    banned = http.completions.create(**kw, logit_bias={str(first): -100}).choices[0].text
    assert banned != greedy and tok.encode(banned, add_bos=False)[0] != first
    whale = tok.encode(" whale", add_bos=False)[0]
    forced = http.completions.create(**kw, logit_bias={str(whale): 100}).choices[0].text
    assert forced == tok.decode([whale] * 4)


LONG_MESSAGES = [
    {
        "role": "user",
        "content": "Describe, one by one and at length, the tides, the currents, the "
        "waves, the salt, the reefs, the whales, the storms and the light of the open sea.",
    }
]


def test_a_repeated_prompt_reuses_the_decode_cache_and_reports_cached_tokens(
    apps: dict[str, str], offline: Engine
) -> None:
    """Twice the same prompt through PD: the second time decode pulls only the pages its
    prefix cache misses, ``cached_tokens`` reports the prefill side's hit, and the text is
    the same; nothing is held afterwards. Colocated reports its own hit the same way."""
    page = TINY_ENGINE["page_size"]
    prompt_len = len(offline.tokenizer.encode_chat(LONG_MESSAGES, True))
    assert prompt_len > 2 * page
    full_pages = (prompt_len - 1) // page  # full pages of all but the last prompt token
    kw = {"model": "tiny", "messages": LONG_MESSAGES, "max_tokens": 8, "temperature": 0}
    before = worker_stats(PD, "decode-0")
    replies = [client(apps[PD]).chat.completions.create(**kw) for _ in range(2)]
    after = worker_stats(PD, "decode-0")
    assert after.pulled_pages - before.pulled_pages == (full_pages + 1) + 1
    assert after.reused_pages - before.reused_pages == full_pages
    cached = [r.usage.prompt_tokens_details.cached_tokens for r in replies]
    assert cached == [0, full_pages * page]
    assert replies[0].choices[0].message.content == replies[1].choices[0].message.content
    assert all(wait_until(lambda w=w: holds_nothing(worker_stats(PD, w)), 5) for w in PD_WORKERS)
    colocated = [client(apps[COLOCATED]).chat.completions.create(**kw) for _ in range(2)]
    assert [r.usage.prompt_tokens_details.cached_tokens for r in colocated] == cached


def test_a_prefill_time_out_says_what_timed_out() -> None:
    """asyncio's TimeoutError has no message: the 503 read "timed out ()"."""
    said = prefill_failure(asyncio.TimeoutError(), 30.0)
    assert said == "no prefill result within prefill_timeout_s (30 s)", said
    assert prefill_failure(RuntimeError("x"), 30.0) == "RuntimeError"


def test_a_stalled_prefill_names_the_check_not_the_ceiling() -> None:
    """A stall (no progress over prefill_stall_timeout_s) is not the ceiling: the 503 read
    "no prefill result within prefill_timeout_s (600 s)" after 30 s."""
    stalled = PrefillStalled("replica's engine finished no step in x (30 s)")
    said = prefill_failure(stalled, 600.0)
    assert said == "prefill given up: replica's engine finished no step in x (30 s)", said
