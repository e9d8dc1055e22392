"""dsv3serve.v1.Generation through Ray Serve's gRPC proxy, beside HTTP, on a real cluster.

One PD app (router, prefill and decode replicas, KV through shared memory) answers both
the official ``openai`` client over HTTP and a ``grpcio`` client over gRPC. The router
admits at most two requests, so two held streams overload it. The same app serves the
routes vLLM clients call beside generation (``/metrics`` on the API port, ``HEAD
/health``, ``models.retrieve``, ``/version``, ``/tokenize``): their wiring in the Serve
ingress is checked here, their behaviour in tests/router/test_openai_utility.py.
"""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
import jsonschema
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from ray.serve._private.logging_utils import get_serve_logs_dir
from refusal_util import first_refusal
from serving_util import (
    TINY_ENGINE,
    ServeCluster,
    free_port,
    holds_nothing,
    running_app,
    serving_config,
    wait_until,
    worker_stats,
)

from router.api.grpc_api import grpc_code
from router.api.grpc_stream_end import DROPPED_AT_WRITE
from router.launch_usage import grpc_example
from router.proto import generate_pb2 as pb
from router.proto.generate_pb2_grpc import GenerationStub
from workers.protocol import WorkerStats

APP = "grpcpd"
META = [("application", APP)]
MAX_IN_FLIGHT = 2
MAX_MODEL_LEN = 8192
PROMPT = "The sea is"
MESSAGES = [{"role": "user", "content": "Tell me about the sea, in detail."}]
PD_WORKERS = ("prefill-0", "decode-0")
VOCAB = 129280  # the tiny model's vocabulary
Code = grpc.StatusCode


@dataclass(frozen=True)
class Served:
    url: str
    stub: GenerationStub
    metrics_url: str
    grpc_port: int


@pytest.fixture(scope="module")
def served(serve_cluster: ServeCluster) -> Iterator[Served]:
    grpc_port, metrics_port = serve_cluster.grpc_port, free_port()
    cfg = serving_config(
        engine=TINY_ENGINE | {"max_model_len": MAX_MODEL_LEN},
        router={
            "served_model_name": "tiny",
            "max_in_flight": MAX_IN_FLIGHT,
            "max_queued_requests": 1,  # Serve's proxy holds one more, then refuses
            "metrics_port": metrics_port,
        },
    )
    with (
        running_app(serve_cluster.base, APP, cfg) as url,
        grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel,
    ):
        metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
        yield Served(url, GenerationStub(channel), metrics_url, grpc_port)


def http_client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)


def greedy(max_tokens: int, **fields: object) -> pb.SamplingOptions:
    return pb.SamplingOptions(max_tokens=max_tokens, temperature=0, **fields)


def long_stream(stub: GenerationStub, **kwargs: object) -> grpc.Future:
    """A stream that would run for thousands of tokens."""
    request = pb.GenerateRequest(
        text=PROMPT, sampling=pb.SamplingOptions(max_tokens=4000, ignore_eos=True)
    )
    return stub.GenerateStream(request, metadata=META, **kwargs)


def assert_pages_return(timeout_s: float = 10) -> None:
    """Every PD worker ends up holding nothing; the failure names what is still held."""
    for w in PD_WORKERS:
        if not wait_until(lambda w=w: holds_nothing(worker_stats(APP, w)), timeout_s):
            raise AssertionError(f"{w} still holds: {worker_stats(APP, w)}")


def grpc_answers(metrics_url: str, status: str) -> float:
    """The router's ``requests_total`` for gRPC answers with ``status``."""
    text = httpx.get(metrics_url, timeout=30).text
    wanted = {"protocol": "grpc", "status": status, "role": "router"}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.endswith("requests_total") and wanted.items() <= sample.labels.items():
                return sample.value
    return 0.0


def test_health(served: Served) -> None:
    reply = served.stub.Health(pb.HealthRequest(), metadata=META, timeout=30)
    assert (reply.status, reply.model, reply.max_model_len) == ("ok", "tiny", MAX_MODEL_LEN)


def test_the_printed_grpc_example_streams_a_reply(served: Served) -> None:
    """The Python line ``dsv3serve serve`` prints (and docs/api.md shows) instead of grpcurl."""
    line = grpc_example(served.grpc_port, APP)
    done = subprocess.run(line, shell=True, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip(), done.stderr


def test_api_port_serves_what_vllm_clients_call(served: Served) -> None:
    client = http_client(served.url)
    assert client.models.retrieve("tiny").id == "tiny"
    head = httpx.head(served.url + "/health", timeout=30)
    assert head.status_code == 200 and head.content == b""
    assert httpx.get(served.url + "/version", timeout=30).json()["version"]
    tokens = httpx.post(served.url + "/tokenize", json={"prompt": "hi"}, timeout=30).json()
    assert tokens["count"] == len(tokens["tokens"]) == 2  # BOS, "hi"
    text = httpx.post(served.url + "/detokenize", json=tokens, timeout=30).json()["prompt"]
    assert text.endswith("hi")
    scrape = httpx.get(served.url + "/metrics", timeout=60)
    assert scrape.headers["content-type"].startswith("text/plain; version=0.0.4")
    roles = {
        sample.labels.get("role")
        for family in text_string_to_metric_families(scrape.text)
        for sample in family.samples
    }
    assert {"router", "prefill", "decode"} <= roles, roles  # the router's and the workers'


def test_streamed_greedy_completion_equals_http(served: Served) -> None:
    http = http_client(served.url).completions.create(
        model="tiny", prompt=PROMPT, max_tokens=16, temperature=0
    )
    request = pb.GenerateRequest(text=PROMPT, sampling=greedy(16), model="tiny")
    messages = list(served.stub.GenerateStream(request, metadata=META, timeout=60))
    *pieces, last = messages
    assert "".join(m.choice.text for m in pieces) == http.choices[0].text
    assert pieces[-1].choice.finish_reason == http.choices[0].finish_reason
    assert last.usage.prompt_tokens == http.usage.prompt_tokens
    assert last.usage.completion_tokens == http.usage.completion_tokens == 16
    assert {m.request_id for m in messages} == {messages[0].request_id}
    assert messages[0].request_id.startswith("cmpl-")


def test_streamed_greedy_chat_equals_http(served: Served) -> None:
    http = http_client(served.url).chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=12, temperature=0
    )
    request = pb.ChatRequest(messages=[pb.ChatMessage(**m) for m in MESSAGES], sampling=greedy(12))
    stream = served.stub.ChatCompleteStream(request, metadata=META, timeout=60)
    text = "".join(m.choice.text for m in stream)
    assert text == http.choices[0].message.content
    whole = served.stub.ChatComplete(request, metadata=META, timeout=60)
    assert whole.choices[0].text == text and whole.request_id.startswith("chatcmpl-")


def test_unary_n2_logprobs_and_token_prompt(served: Served) -> None:
    request = pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=[0, 100, 200, 300]), sampling=greedy(6, n=2, logprobs=2)
    )
    reply = served.stub.Generate(request, metadata=META, timeout=60)
    assert [c.index for c in reply.choices] == [0, 1]
    assert reply.choices[0].text == reply.choices[1].text  # greedy: both the same
    for choice in reply.choices:
        assert len(choice.token_ids) == len(choice.logprobs) == 6
        first = choice.logprobs[0]
        assert first.token_id == choice.token_ids[0] and first.logprob <= 0
        assert len(first.top_logprobs) == 2
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (4, 12)


SCHEMA = {
    "type": "object",
    "properties": {"size": {"type": "integer", "minimum": 1, "maximum": 9}},
    "required": ["size"],
    "additionalProperties": False,
}


def test_logit_bias_and_json_schema_over_grpc(served: Served) -> None:
    """The same structured-output and logit_bias behaviour as over HTTP."""
    plain = served.stub.Generate(sampling(max_tokens=4, temperature=0), metadata=META, timeout=60)
    greedy_ids = list(plain.choices[0].token_ids)
    forced = served.stub.Generate(
        sampling(max_tokens=4, temperature=0, logit_bias={77: 100.0}), metadata=META, timeout=60
    )
    assert list(forced.choices[0].token_ids) == [77] * 4 != greedy_ids
    options = {"max_tokens": 40, "temperature": 1.0, "n": 3, "seed": 5}
    request = sampling(**options, json_schema=json.dumps(SCHEMA), json_schema_strict=True)
    reply = served.stub.Generate(request, metadata=META, timeout=120)
    for choice in reply.choices:
        jsonschema.validate(json.loads(choice.text), SCHEMA)


def bad(name: str, mentions: str, request: object) -> object:
    return pytest.param(mentions, request, id=name)


def sampling(**fields: object) -> pb.GenerateRequest:
    return pb.GenerateRequest(text=PROMPT, sampling=pb.SamplingOptions(**fields))


BAD_REQUESTS = [
    bad("temperature", "temperature: must be >= 0", sampling(temperature=-1)),
    bad("empty-prompt", "prompt must not be empty", pb.GenerateRequest(text="")),
    bad("no-prompt", "prompt: Field required", pb.GenerateRequest(sampling=greedy(4))),
    bad(
        "negative-id",
        "token ids must be in [0, ",
        pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5, -1])),
    ),
    bad("long-prompt", "context length", pb.GenerateRequest(token_ids=pb.TokenIds(ids=[7] * 8192))),
    bad("long-completion", "context length", sampling(max_tokens=MAX_MODEL_LEN)),
    bad("n-0", "n: must be >= 1", sampling(n=0)),
    bad("n-17", "n must be <= 16", sampling(n=17)),
    bad("top-p", "top_p", sampling(top_p=0)),
    bad("logprobs", "logprobs", sampling(logprobs=21)),
    bad("no-messages", "messages", pb.ChatRequest()),
    bad("role", "role", pb.ChatRequest(messages=[pb.ChatMessage(role="robot", content="hi")])),
    bad("id-over-vocab", "vocabulary", pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5, VOCAB]))),
    bad("stop-id-over-vocab", "stop_token_ids", sampling(stop_token_ids=[VOCAB])),
    bad("schema-not-json", "json_schema is not valid JSON", sampling(json_schema="{nope")),
    bad("bias-range", "logit_bias", sampling(logit_bias={5: 101.0})),
    bad(
        "min-over-max",
        "min_tokens (3) must be <= max_tokens (2)",
        sampling(max_tokens=2, min_tokens=3),
    ),
]


def call(stub: GenerationStub, request: object, stream: bool) -> object:
    """The RPC for ``request``'s type, read to the end."""
    name = "ChatComplete" if isinstance(request, pb.ChatRequest) else "Generate"
    if stream:
        return list(getattr(stub, name + "Stream")(request, metadata=META, timeout=30))
    return getattr(stub, name)(request, metadata=META, timeout=30)


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
@pytest.mark.parametrize(("mentions", "request_"), BAD_REQUESTS)
def test_invalid_arguments(served: Served, mentions: str, request_: object, stream: bool) -> None:
    with pytest.raises(grpc.RpcError) as info:
        call(served.stub, request_, stream)
    assert info.value.code() == Code.INVALID_ARGUMENT, info.value.details()
    assert mentions in info.value.details()


def test_unknown_model_is_not_found(served: Served) -> None:
    request = pb.GenerateRequest(text=PROMPT, sampling=greedy(2), model="gpt-4")
    with pytest.raises(grpc.RpcError) as info:
        served.stub.Generate(request, metadata=META, timeout=30)
    assert info.value.code() == Code.NOT_FOUND


def admitted_long_stream(stub: GenerationStub, tries: int = 10) -> grpc.Future:
    """A long stream that is admitted and generating. Serve's proxy may still count the
    calls of an earlier test as ongoing for a moment (its view of a router's load lags),
    and then refuse: that refusal is not the one under test, so it is tried again."""
    for _ in range(tries):
        stream = long_stream(stub)
        try:
            next(stream)
            return stream
        except grpc.RpcError as exc:
            if exc.code() != Code.RESOURCE_EXHAUSTED:
                raise
            time.sleep(1.0)  # Serve's view of the router's load catches up
    raise AssertionError(f"no long stream was admitted in {tries} tries")


def _exhausted(call: Future[pb.GenerateResponse]) -> bool:
    err = call.exception()
    return isinstance(err, grpc.RpcError) and err.code() == Code.RESOURCE_EXHAUSTED


def test_overload_is_resource_exhausted(served: Served) -> None:
    """With the router's budget held, Serve's proxy queues one more call (its queue holds
    one) and refuses the next at once, with the capacity message; the queued one runs once
    the held streams end."""
    held: list[grpc.Future] = []
    request = pb.GenerateRequest(text=PROMPT, sampling=greedy(2))
    with ThreadPoolExecutor(4) as pool:
        try:
            for _ in range(MAX_IN_FLIGHT):  # one at a time: Serve counts a burst as queued
                held.append(admitted_long_stream(served.stub))

            def submit() -> Future[pb.GenerateResponse]:
                return pool.submit(served.stub.Generate, request, metadata=META, timeout=120)

            refused, queued = first_refusal(submit, _exhausted)
            details = refused.exception().details()  # type: ignore[union-attr]
            assert "capacity" in details and "num_queued" not in details
        finally:
            for stream in held:
                stream.cancel()
        for call in queued:  # served once a slot came free (or refused the same way)
            assert _exhausted(call) or call.result().choices[0].token_ids
    assert_pages_return()
    assert (
        served.stub.Generate(
            pb.GenerateRequest(text=PROMPT, sampling=greedy(2)), metadata=META, timeout=60
        )
        .choices[0]
        .token_ids
    )  # the slots came back


def test_cancel_mid_stream_aborts_on_both_workers(served: Served) -> None:
    cancelled_before = grpc_answers(served.metrics_url, "CANCELLED")
    stream = long_stream(served.stub)
    try:
        for _ in range(3):
            next(stream)
        busy = worker_stats(APP, "decode-0")
        assert busy.live_requests == 1 and busy.free_pages < busy.num_pages, busy
    finally:
        stream.cancel()  # also when an assertion failed: later tests need the pages
    with pytest.raises(grpc.RpcError) as info:
        next(stream)
    assert info.value.code() == Code.CANCELLED
    assert_pages_return()
    assert wait_until(
        lambda: grpc_answers(served.metrics_url, "CANCELLED") > cancelled_before, 10
    )  # the router saw the cancellation, not a failure


def dropped_at_write() -> int:
    """Calls the proxy logged as dropped at a write (``router.api.grpc_stream_end``) so far."""
    logs = Path(get_serve_logs_dir()).glob("proxy_*.log")
    return sum(path.read_text(errors="replace").count(DROPPED_AT_WRITE) for path in logs)


def held_pages(stats: WorkerStats) -> int:
    return stats.num_pages - stats.free_pages - stats.evictable_pages


@pytest.mark.parametrize("ending", ["cancel", "deadline"])
def test_a_call_ended_while_the_proxy_waits_to_write_frees_pages(
    served: Served, ending: str
) -> None:
    """A client that stops reading fills its stream's small HTTP/2 window, so Serve's
    proxy is in a write, its handler suspended at a ``yield``, when the call ends (a
    cancel or the deadline). Serve then closes its handler there without cancelling the
    replica's response (Ray 2.60, ``proxy.py`` ``send_request_to_replica``), and the router
    stream ran on to ``max_tokens`` with its pages held; ``router.api.grpc_proxy`` cancels
    it. (Fails without ``cancel_replica_call``: decode-0 still holds the request.) The
    proxy's log line for a call dropped at a write shows that the call did end there.

    The window is 1 KiB and each token's message, with its 20 top logprobs, a few hundred
    bytes: once decode-0 holds 4 pages of 16 tokens (some 45 generated), the proxy's
    writes have long been waiting."""
    window = [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 1024)]
    request = pb.GenerateRequest(
        text=PROMPT, sampling=pb.SamplingOptions(max_tokens=4000, ignore_eos=True, logprobs=20)
    )
    timeout = 10.0 if ending == "deadline" else None
    dropped_before = dropped_at_write()
    with grpc.insecure_channel(f"127.0.0.1:{served.grpc_port}", options=window) as channel:
        stream = GenerationStub(channel).GenerateStream(request, metadata=META, timeout=timeout)
        try:
            next(stream)  # then not reading: the window fills and the proxy's write waits
            assert wait_until(lambda: held_pages(worker_stats(APP, "decode-0")) >= 4, 8)
            busy = worker_stats(APP, "decode-0")
            assert busy.live_requests == 1, busy
            if ending == "deadline":  # still not reading (that would let the write go on)
                assert wait_until(stream.done, 2 * timeout)
        finally:
            if ending == "cancel":
                stream.cancel()
        with pytest.raises(grpc.RpcError) as info:
            for _ in stream:
                pass
    wanted = Code.CANCELLED if ending == "cancel" else Code.DEADLINE_EXCEEDED
    assert info.value.code() == wanted
    assert wait_until(lambda: dropped_at_write() > dropped_before, 10), "not dropped at a write"
    assert_pages_return()


def test_client_deadline_is_deadline_exceeded_and_frees_pages(served: Served) -> None:
    start = time.monotonic()
    with pytest.raises(grpc.RpcError) as info:
        for _ in long_stream(served.stub, timeout=2.0):
            pass
    assert info.value.code() == Code.DEADLINE_EXCEEDED
    assert time.monotonic() - start < 10
    assert_pages_return()


@pytest.mark.parametrize(
    ("status", "code"),
    [
        (400, Code.INVALID_ARGUMENT),
        (401, Code.UNAUTHENTICATED),
        (404, Code.NOT_FOUND),
        (413, Code.INVALID_ARGUMENT),
        (422, Code.INVALID_ARGUMENT),
        (429, Code.RESOURCE_EXHAUSTED),
        (499, Code.CANCELLED),
        (500, Code.INTERNAL),
        (503, Code.UNAVAILABLE),
        (504, Code.DEADLINE_EXCEEDED),
    ],
)
def test_http_status_to_grpc_code(status: int, code: grpc.StatusCode) -> None:
    assert grpc_code(status) == code
