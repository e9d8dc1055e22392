"""Serve's proxy refusing for full routers, on real local Ray and Serve, the proxy running
our middlewares as `dsv3serve serve` starts it.

A stand-in for the router (``HeldRouterStandIn``: it holds each request it admits, so the
budget stays full) is deployed with the router's own admission options
(``router.app.serve_admission_options``: ``max_in_flight`` 1, ``max_queued_requests`` 1).
With its one request held, of four more sent at once about one waits in the proxy's queue
(Serve counts it loosely; it is served once the first ends) and the others are refused
while the first is still held, with 429, ``Retry-After`` and an OpenAI body: the official
client raises ``RateLimitError``."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait

import openai
import pytest
import ray
from ray import serve
from serving_util import local_serve, wait_until
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
def client() -> Iterator[openai.OpenAI]:
    options = serve_admission_options(RouterSettings(max_in_flight=1, max_queued_requests=1))
    with local_serve() as base:
        serve.run(HeldRouterStandIn.options(**options).bind(), name=APP, route_prefix=f"/{APP}")
        yield openai.OpenAI(base_url=f"{base}/{APP}/v1", api_key="none", max_retries=0, timeout=120)


def chat(client: openai.OpenAI) -> str:
    out = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
    return out.choices[0].message.content or ""


def ongoing() -> int:
    """Requests the stand-in replica is running now."""
    names = [a for a in ray.util.list_named_actors(all_namespaces=True) if APP in a["name"]]
    replicas = [ray.get_actor(a["name"], namespace=a["namespace"]) for a in names]
    return sum(ray.get(r.get_num_ongoing_requests.remote()) for r in replicas)


def refusal(future: Future[str]) -> openai.RateLimitError | None:
    err = future.exception()
    if err is None:
        return None
    assert isinstance(err, openai.RateLimitError), f"expected a 429 or a completion, got {err!r}"
    return err


def test_a_full_router_budget_is_refused_by_the_proxy_at_once(client: openai.OpenAI) -> None:
    with ThreadPoolExecutor(5) as pool:
        first = pool.submit(chat, client)
        assert wait_until(lambda: ongoing() == 1, timeout_s=60)
        more = [pool.submit(chat, client) for _ in range(4)]
        done, _ = wait(more, timeout=HOLD_S / 2, return_when="ALL_COMPLETED")
        assert not first.done(), "the held request ended before the refusals were in"
        refused = [err for err in map(refusal, done) if err is not None]
        assert len(refused) >= 2, f"expected refusals at once, got {len(refused)}"
        assert first.result() == "ok"
        served = [f.result() for f in more if f not in done or refusal(f) is None]
    assert served == ["ok"] * len(served) and len(served) <= 2, served  # queued, then served
    for err in refused:
        assert err.status_code == 429 and err.response.headers["retry-after"] == "1"
        assert err.response.json()["error"]["code"] == RATE_LIMITED
