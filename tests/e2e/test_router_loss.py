"""Two router replicas on real local Ray: each has its own metrics port, and killing the
one serving a stream ends that stream with an error event (Serve's proxy runs
router/api/proxy_middleware.py, as `dsv3serve serve` sets it up) while the other router
keeps serving; the decode replica stops decoding for the dead router
(workers/caller_watch.py); gRPC calls on a killed router end UNAVAILABLE with a clean
message (router/api/grpc_proxy.py)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc
import httpx
import openai
import pytest
import ray
from prometheus_client.parser import text_string_to_metric_families
from ray import serve
from serving_util import (
    ServeCluster,
    free_port_pair,
    running_app,
    serving_config,
    wait_until,
    worker_stats,
)

from router.api.proxy_middleware import ROUTER_LOST_CODE, STREAM_CUT_CODE
from router.proto import generate_pb2 as pb
from router.proto.generate_pb2_grpc import GenerationStub

APP = "router-loss"
STREAM_TOKENS = 4000  # long enough to be mid-stream when its router is killed
META = [("application", APP)]


@pytest.fixture(scope="module")
def served(serve_cluster: ServeCluster) -> Iterator[tuple[str, int, int]]:
    metrics_port, grpc_port = free_port_pair(), serve_cluster.grpc_port
    router = {"num_replicas": 2, "metrics_port": metrics_port, "max_decode_migrations": 0}
    cfg = serving_config(mode="pd", router=router)
    with running_app(serve_cluster.base, APP, cfg) as url:
        yield url, metrics_port, grpc_port


def router_actors() -> list[ray.actor.ActorHandle]:
    return [
        ray.get_actor(a["name"], namespace=a["namespace"])
        for a in ray.util.list_named_actors(all_namespaces=True)
        if f"{APP}#router#" in a["name"]
    ]


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)


def decoded_tokens() -> float:
    """Tokens the decode replica generated since it started."""
    handle = serve.get_deployment_handle("decode-0", app_name=APP)
    text = handle.metrics.remote().result()
    return sum(
        s.value
        for family in text_string_to_metric_families(text.decode())
        for s in family.samples
        if s.name == "dsv3serve:generation_tokens_total"
    )


def busy_router(routers: list[ray.actor.ActorHandle]) -> ray.actor.ActorHandle:
    """A router replica with a request in flight (waits for one)."""
    busy = lambda: [r for r in routers if ray.get(r.get_num_ongoing_requests.remote()) > 0]  # noqa: E731
    assert wait_until(lambda: bool(busy()), timeout_s=120)
    return busy()[0]


def chat(url: str) -> str:
    reply = client(url).chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=4, temperature=0
    )
    return reply.choices[0].message.content or ""


def test_each_router_replica_serves_its_own_metrics_port(served: tuple[str, int, int]) -> None:
    url, port, _ = served
    chat(url)
    texts = [httpx.get(f"http://127.0.0.1:{port + k}/metrics", timeout=30).text for k in (0, 1)]
    for k, text in enumerate(texts):
        assert f'replica="router-{k}"' in text, f"port {port + k} is not router-{k}"
    # router-0 merges the workers' series once; router-1 exposes only its own
    assert 'role="decode"' in texts[0] and 'role="decode"' not in texts[1]


def test_killed_router_ends_its_stream_with_an_error_and_the_other_serves(
    served: tuple[str, int, int],
) -> None:
    """... and the decode replica stops decoding the stream (not on to max_tokens)."""
    url, _, _ = served
    routers = router_actors()
    assert len(routers) == 2
    want = chat(url)  # greedy: every router's answer, before and after the kill
    assert want, "expected a non-empty greedy answer"
    tokens_before = decoded_tokens()
    stream = client(url).chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Count forever."}],
        max_tokens=STREAM_TOKENS,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    chunks = 0
    with pytest.raises(openai.APIError) as raised:
        for _ in stream:
            chunks += 1
            if chunks == 3:
                busy = [r for r in routers if ray.get(r.get_num_ongoing_requests.remote()) > 0]
                assert len(busy) == 1, "exactly one router serves the stream"
                ray.kill(busy[0], no_restart=True)
                killed_at = time.monotonic()
    error = raised.value  # without the proxy middleware: a body-less connection error
    assert isinstance(error.body, dict), f"no error event: {type(error).__name__}: {error}"
    assert error.body["code"] == STREAM_CUT_CODE
    assert chunks < STREAM_TOKENS / 2
    cut_after = time.monotonic() - killed_at
    assert cut_after < 10, f"the cut stream took {cut_after:.1f} s to end"
    idle = lambda: worker_stats(APP, "decode-0").live_requests == 0  # noqa: E731
    assert wait_until(idle, timeout_s=600), "decode still runs the dead router's stream"
    decoded = decoded_tokens() - tokens_before
    assert decoded < STREAM_TOKENS / 2, f"decode went on for {decoded:.0f} tokens"
    # The other router answers at once; Serve restarts the killed one meanwhile.
    answers = [chat(url) for _ in range(5)]
    assert answers == [want] * 5, "a surviving router's answer differs from before the kill"
    assert wait_until(lambda: len(router_actors()) == 2, timeout_s=60)


def test_killed_router_with_queued_requests_answers_json_503s_not_500s(
    served: tuple[str, int, int],
) -> None:
    """Non-stream requests in flight on a router that is killed: each gets a 200 or a 503
    with an OpenAI error body and Retry-After; none a 500 or a non-JSON body."""
    url, _, _ = served
    assert wait_until(lambda: len(router_actors()) == 2, timeout_s=60)
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "Count forever."}],
        "max_tokens": 400,
        "temperature": 0,
        "ignore_eos": True,
    }
    with ThreadPoolExecutor(8) as pool:
        futures = [
            pool.submit(httpx.post, f"{url}/v1/chat/completions", json=body, timeout=300)
            for _ in range(8)
        ]
        ray.kill(busy_router(router_actors()), no_restart=True)
        replies = [f.result() for f in futures]
    statuses = sorted(r.status_code for r in replies)
    assert set(statuses) <= {200, 503} and 503 in statuses, statuses
    for reply in replies:
        payload = reply.json()  # every body is JSON
        if reply.status_code == 503:
            assert payload["error"]["code"] == ROUTER_LOST_CODE
            assert reply.headers["retry-after"] == "1"


def grpc_outcome(call: Callable[[], object]) -> tuple[grpc.StatusCode, str]:
    try:
        call()
    except grpc.RpcError as error:
        return error.code(), error.details() or ""
    return grpc.StatusCode.OK, ""


def test_killed_router_gives_grpc_calls_unavailable_without_ray_internals(
    served: tuple[str, int, int],
) -> None:
    """Unary calls and a stream on gRPC while a router is killed: each ends OK or
    UNAVAILABLE with a clean message (Serve's proxy said INTERNAL with the actor id and
    pid)."""
    _, _, grpc_port = served
    assert wait_until(lambda: len(router_actors()) == 2, timeout_s=60)
    sampling = pb.SamplingOptions(max_tokens=400, ignore_eos=True)
    request = pb.GenerateRequest(text="Count forever.", sampling=sampling)
    with (
        grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel,
        ThreadPoolExecutor(7) as pool,
    ):
        stub = GenerationStub(channel)
        unary = lambda: stub.Generate(request, metadata=META, timeout=300)  # noqa: E731
        streamed = lambda: list(stub.GenerateStream(request, metadata=META, timeout=300))  # noqa: E731
        futures = [pool.submit(grpc_outcome, unary) for _ in range(6)]
        futures.append(pool.submit(grpc_outcome, streamed))
        ray.kill(busy_router(router_actors()), no_restart=True)
        outcomes = [f.result() for f in futures]
    codes = [code for code, _ in outcomes]
    assert set(codes) <= {grpc.StatusCode.OK, grpc.StatusCode.UNAVAILABLE}, outcomes
    assert grpc.StatusCode.UNAVAILABLE in codes, outcomes
    for _, details in outcomes:
        assert "actor" not in details.lower() and "pid" not in details, details
