"""router/api/proxy_admission.py: the door's exact budget in Serve's proxy, played with a
stand-in for the proxy's inner app (``HeldProxyApp``: it holds each request until the test
lets it go, as a router replica streaming a completion would). The budget's sum over apps
is ``router.api.admission.admission_limit``."""

from __future__ import annotations

import asyncio
import json

import pytest
from ray.serve._private.http_util import _apply_middlewares as apply_middlewares
from starlette.types import Message, Receive, Scope, Send

from router.api.admission import admission_limit, serve_queue_limit
from router.api.proxy_admission import (
    BURST_ARRIVALS,
    PROXY_ADMISSION_ENV,
    ArrivalsFirst,
    ProxyAdmission,
    limit_from_env,
)
from router.api.proxy_middleware import proxy_middlewares
from router.config import RouterSettings
from router.launch import use_proxy_middleware

CHAT = "/v1/chat/completions"


class HeldProxyApp:
    """Answers 200 to each request once ``release`` is set; counts the calls it got."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.calls = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.calls += 1
        await self.release.wait()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}", "more_body": False})


async def call(door: ProxyAdmission, path: str = CHAT, method: str = "POST") -> list[Message]:
    sent: list[Message] = []

    async def send(message: Message) -> None:
        sent.append(message)

    async def receive() -> Message:
        return {"type": "http.request", "body": b"{}", "more_body": False}

    await door({"type": "http", "method": method, "path": path}, receive, send)
    return sent


def status(sent: list[Message]) -> int:
    return sent[0]["status"]


def test_past_the_budget_the_door_refuses_at_once_with_an_openai_429() -> None:
    async def run() -> tuple[list[list[Message]], list[Message], list[Message], int]:
        inner = HeldProxyApp()
        door = ProxyAdmission(inner, limit=2)
        held = [asyncio.create_task(call(door)) for _ in range(2)]
        await asyncio.sleep(0)
        assert door.in_flight == 2
        refused = await asyncio.wait_for(call(door), 30)  # while the two are still held
        models = asyncio.create_task(call(door, "/v1/models", "GET"))  # not counted
        await asyncio.sleep(0)
        assert inner.calls == 3  # the two held and the models call: never the refused one
        inner.release.set()
        done = [await task for task in held]
        after = await call(door)  # the budget is free again
        await models
        return done, refused, after, door.in_flight

    done, refused, after, in_flight = asyncio.run(run())
    assert [status(sent) for sent in done] == [200, 200] and status(after) == 200
    assert status(refused) == 429 and in_flight == 0
    headers = {bytes(k).lower(): bytes(v) for k, v in refused[0]["headers"]}
    assert headers[b"retry-after"] == b"1"
    assert headers[b"content-type"] == b"application/json"
    error = json.loads(refused[1]["body"])["error"]
    assert error["code"] == "rate_limit_exceeded" and "capacity" in error["message"]


def test_a_request_that_raises_gives_its_place_back() -> None:
    async def failing(scope: Scope, receive: Receive, send: Send) -> None:
        raise RuntimeError("the inner app failed")

    async def run() -> int:
        door = ProxyAdmission(failing, limit=1)
        for _ in range(3):
            with pytest.raises(RuntimeError):
                await call(door)
        return door.in_flight

    assert asyncio.run(run()) == 0


def test_without_a_budget_the_door_counts_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """More generation requests at once than a burst takes (:data:`BURST_ARRIVALS`), all
    held inside: every one goes straight on, none is counted in flight, no burst starts."""
    monkeypatch.delenv(PROXY_ADMISSION_ENV, raising=False)
    arrivals = BURST_ARRIVALS + 4

    async def run() -> tuple[int | None, int, int, bool, list[int]]:
        inner = HeldProxyApp()
        door = ProxyAdmission(inner)
        held = [asyncio.create_task(call(door)) for _ in range(arrivals)]
        for _ in range(3):  # let every task reach the inner app (none waits on a burst)
            await asyncio.sleep(0)
        seen = (door.limit, inner.calls, door.in_flight, door.arrivals.in_burst)
        inner.release.set()
        return *seen, [status(await task) for task in held]

    limit, entered, in_flight, in_burst, statuses = asyncio.run(run())
    assert limit is None
    assert entered == arrivals and in_flight == 0 and not in_burst
    assert statuses == [200] * arrivals


def test_the_budget_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(PROXY_ADMISSION_ENV, "528")
    assert ProxyAdmission(HeldProxyApp()).limit == 528
    monkeypatch.setenv(PROXY_ADMISSION_ENV, "0")
    with pytest.raises(ValueError, match="positive"):
        limit_from_env()


def test_the_budget_sums_every_apps_routers_and_queue() -> None:
    one = RouterSettings(num_replicas=2, max_in_flight=256, max_queued_requests=16)
    two = RouterSettings(num_replicas=1, max_in_flight=8, max_queued_requests=1024)
    assert admission_limit([one]) == 528
    assert admission_limit([one, two]) == 528 + 1032
    unlimited = RouterSettings(max_queued_requests=-1)
    assert admission_limit([one, unlimited]) is None


def test_the_door_is_the_proxys_outermost_middleware_when_a_budget_is_set(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Built as Serve's proxy builds its stack from the callback's list (its last entry
    ends up outermost): a request meets the door before any other middleware."""
    monkeypatch.setenv(PROXY_ADMISSION_ENV, "528")
    stack = apply_middlewares(HeldProxyApp(), proxy_middlewares())
    assert isinstance(stack, ProxyAdmission)
    monkeypatch.delenv(PROXY_ADMISSION_ENV)
    assert ProxyAdmission not in [m.cls for m in proxy_middlewares()]


def test_launch_sets_and_clears_the_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(PROXY_ADMISSION_ENV, raising=False)
    use_proxy_middleware(528)
    assert limit_from_env() == 528
    use_proxy_middleware()
    assert limit_from_env() is None


def test_with_the_door_counting_serves_queue_is_only_a_backstop() -> None:
    router = RouterSettings(num_replicas=2, max_in_flight=256, max_queued_requests=16)
    assert serve_queue_limit(router, door=False) == 16
    assert serve_queue_limit(router, door=True) == 528  # what the door lets through at most
    unlimited = RouterSettings(max_queued_requests=-1)
    assert serve_queue_limit(unlimited, door=True) == -1


class LoggingProxyApp(HeldProxyApp):
    """Logs each request's entry (its ``id`` from the scope), then holds it as HeldProxyApp."""

    def __init__(self, log: list[str]) -> None:
        super().__init__()
        self.log = log

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.log.append(f"enter {scope['id']}")
        await self.release.wait()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}", "more_body": False})


def test_in_a_burst_the_refusals_go_out_before_the_admitted_go_on() -> None:
    """20 arrivals at once against a budget of 16 (a burst from the 16th arrival on): the 15
    before the burst go on at once; the 16th waits until the 4 refused have their 429 (in
    Serve's proxy the admitted are routed, about a millisecond each, in the same loop that
    has to reach the refused ones)."""
    log: list[str] = []

    async def one(door: ProxyAdmission, i: int) -> None:
        async def send(message: Message) -> None:
            if message["type"] == "http.response.start" and message["status"] == 429:
                log.append(f"429 {i}")

        async def receive() -> Message:
            return {"type": "http.request", "body": b"{}", "more_body": False}

        await door({"type": "http", "method": "POST", "path": CHAT, "id": i}, receive, send)

    async def run() -> None:
        inner = LoggingProxyApp(log)
        door = ProxyAdmission(inner, limit=16)
        tasks = [asyncio.create_task(one(door, i)) for i in range(1, 21)]
        for _ in range(3000):  # until every request entered or was refused (30 s at most)
            if len(log) == 20:
                break
            await asyncio.sleep(0.01)
        inner.release.set()
        await asyncio.gather(*tasks)

    asyncio.run(run())
    refused = [log.index(f"429 {i}") for i in range(17, 21)]
    assert len(log) == 20 and log[:15] == [f"enter {i}" for i in range(1, 16)]
    assert log.index("enter 16") > max(refused)


def test_a_burst_ends_when_arrivals_pause_or_at_max_burst_s() -> None:
    """Arrivals that pause end the burst; arrivals that never stop end it at ``max_burst_s``.
    Outside a burst ``wait`` returns at once."""

    async def run() -> tuple[bool, bool, float, bool]:
        loop = asyncio.get_running_loop()
        gate = ArrivalsFirst(max_burst_s=0.2)
        await asyncio.wait_for(gate.wait(), 1)  # no burst: no wait
        for _ in range(BURST_ARRIVALS):
            gate.arrive(loop.time())
        started = gate.in_burst
        await asyncio.wait_for(gate.wait(), 30)  # ends once nothing arrives for QUIET_S
        paused_ends = not gate.in_burst
        stop = asyncio.Event()

        async def arrive_forever() -> None:
            while not stop.is_set():
                gate.arrive(loop.time())
                await asyncio.sleep(0.001)

        feeder = asyncio.create_task(arrive_forever())
        while not gate.in_burst:
            await asyncio.sleep(0.001)
        start = loop.time()
        await asyncio.wait_for(gate.wait(), 30)
        waited, still_arriving = loop.time() - start, not feeder.done()
        stop.set()
        await feeder
        return started, paused_ends, waited, still_arriving

    started, paused_ends, waited, still_arriving = asyncio.run(run())
    assert started and paused_ends
    assert still_arriving and waited >= 0.15  # the cap ended it, arrivals went on
