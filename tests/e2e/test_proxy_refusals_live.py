"""Serve's proxy refusing for full routers, on real local Ray and Serve, the proxy running
our middlewares as `dsv3serve serve` starts it.

A stand-in for the router (``HeldRouterStandIn``: it holds each request it admits, so the
budget stays full) is deployed with the router's own admission options
(``router.app.serve_admission_options``: ``max_in_flight`` 1, ``max_queued_requests`` 1).
With its one request held, one more call waits in the proxy's queue (and is served once the
first ends) and the next is refused while the first is still held, with 429,
``Retry-After`` and an OpenAI body: the official client raises ``RateLimitError``. The
calls go one at a time (tests/support/refusal_util.py says why)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import openai
import pytest
import ray
from ray import serve
from refusal_util import first_refusal
from serving_util import ServeCluster, wait_until
from starlette.requests import Request
from starlette.responses import JSONResponse

from router.api.proxy_refusals import RATE_LIMITED
from router.app import serve_admission_options
from router.config import RouterSettings

APP = "refusals"
HOLD_S = 10.0  # how long the stand-in holds each request it admits
COMPLETION = {
    "id": "held-1",
    "object": "chat.completion",
    "created": 0,
    "model": "stand-in",
    "choices": [
        {"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}
    ],
}


@serve.deployment
class HeldRouterStandIn:
    """Stands in for a router whose admitted requests take ``HOLD_S`` each: answers any
    request with a minimal chat completion after holding it."""

    async def __call__(self, request: Request) -> JSONResponse:
        await asyncio.sleep(HOLD_S)
        return JSONResponse(COMPLETION)


@pytest.fixture(scope="module")
def client(serve_cluster: ServeCluster) -> Iterator[openai.OpenAI]:
    options = serve_admission_options(RouterSettings(max_in_flight=1, max_queued_requests=1))
    serve.run(HeldRouterStandIn.options(**options).bind(), name=APP, route_prefix=f"/{APP}")
    try:
        base_url = f"{serve_cluster.base}/{APP}/v1"
        yield openai.OpenAI(base_url=base_url, api_key="none", max_retries=0, timeout=120)
    finally:
        serve.delete(APP)


def chat(client: openai.OpenAI) -> str:
    out = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
    return out.choices[0].message.content or ""


def ongoing() -> int:
    """Requests the stand-in replica is running now."""
    names = [a for a in ray.util.list_named_actors(all_namespaces=True) if APP in a["name"]]
    replicas = [ray.get_actor(a["name"], namespace=a["namespace"]) for a in names]
    return sum(ray.get(r.get_num_ongoing_requests.remote()) for r in replicas)


def rate_limited(call: Future[str]) -> bool:
    return isinstance(call.exception(), openai.RateLimitError)


def test_a_full_router_budget_is_refused_by_the_proxy_at_once(client: openai.OpenAI) -> None:
    with ThreadPoolExecutor(5) as pool:
        first = pool.submit(chat, client)
        assert wait_until(lambda: ongoing() == 1, timeout_s=60)
        refused, queued = first_refusal(lambda: pool.submit(chat, client), rate_limited)
        assert not first.done(), "the held request ended before the refusal came"
        assert first.result() == "ok"
        served = [call.result() for call in queued]  # each waited in the queue, then ran
    assert served == ["ok"] * len(served)
    err = refused.exception()
    assert isinstance(err, openai.RateLimitError)
    assert err.status_code == 429 and err.response.headers["retry-after"] == "1"
    assert err.response.json()["error"]["code"] == RATE_LIMITED
