"""Worker hosts without Ray: the PD protocol, leases and error paths on real engines."""

from __future__ import annotations

import asyncio
import logging
import threading

import pytest
from serving_util import holds_nothing
from worker_host_util import (
    GREEDY,
    attempt,
    collect,
    flat,
    host,
    pd_generate,
    pd_hosts,
    request,
)

from dsv3serve.engine.engine import Engine
from dsv3serve.sampling.sampling_params import SamplingParams
from workers.host import EngineHost, WrongRoleError
from workers.protocol import (
    DecodeRequest,
    GenerateRequest,
    ReserveRequest,
    TokenChunk,
)


@pytest.fixture(scope="module")
def hosts() -> dict[str, EngineHost]:
    return pd_hosts()


def test_pd_stream_equals_colocated_tokens_text_and_logprobs(hosts: dict[str, EngineHost]) -> None:
    async def run() -> tuple[list[TokenChunk], list[TokenChunk]]:
        pd = await pd_generate(hosts, "a")
        colo = await collect(hosts["colocated"].generate(request("a")))
        return pd, colo

    pd, colo = asyncio.run(run())
    assert flat(pd, "token_ids") == flat(colo, "token_ids")
    assert "".join(c.text for c in pd) == "".join(c.text for c in colo)
    assert flat(pd, "logprobs") == pytest.approx(flat(colo, "logprobs"), abs=1e-4)
    assert pd[-1].finished and pd[-1].completion_tokens == colo[-1].completion_tokens
    for h in hosts.values():
        assert holds_nothing(h.stats())


def test_unpulled_kv_is_freed_when_its_lease_expires(hosts: dict[str, EngineHost]) -> None:
    prefill = hosts["prefill"]

    async def run() -> None:
        result = await prefill.prefill(attempt(request("never-pulled")))
        assert result.kv is not None
        staged = prefill.stats()
        assert staged.staged_kv == 1 and staged.live_requests == 1
        await asyncio.sleep(1.0)  # lease 0.5 s, reaped every 0.2 s

    asyncio.run(run())
    assert holds_nothing(prefill.stats())


def test_unused_reservation_is_freed_when_its_lease_expires(hosts: dict[str, EngineHost]) -> None:
    decode = hosts["decode"]

    async def run() -> None:
        decode._start_reaper()
        assert (
            await decode.reserve(ReserveRequest(request_id="r", num_tokens=100, lease_s=0.3))
        ).ok
        assert decode.stats().reservations == 1
        await asyncio.sleep(0.8)

    asyncio.run(run())
    assert holds_nothing(decode.stats())


def test_decode_after_released_kv_fails_cleanly_and_frees_the_reservation(
    hosts: dict[str, EngineHost],
) -> None:
    prefill, decode = hosts["prefill"], hosts["decode"]

    async def run() -> list[TokenChunk]:
        assert (await decode.reserve(ReserveRequest(request_id="x", num_tokens=40, lease_s=5))).ok
        result = await prefill.prefill(attempt(request("x")))
        await prefill.release_kv(
            result.kv.request_id
        )  # as if the lease ran out before decode pulled
        msg = DecodeRequest(
            request=request("x"), first_token=result.first.token_ids[0], kv=result.kv
        )
        return await collect(decode.decode(msg))

    chunks = asyncio.run(run())
    assert len(chunks) == 1 and chunks[0].error and chunks[0].error_status == 503
    assert holds_nothing(decode.stats()) and holds_nothing(prefill.stats())


def test_a_full_decode_side_reports_its_progress(hosts: dict[str, EngineHost]) -> None:
    """A refusal carries the decode side's progress (its engine's steps): a
    router waiting for KV room waits on while it grows (router/pd/room_signal.RoomDeadline)."""
    decode = hosts["decode"]
    too_big = ReserveRequest(request_id="big", num_tokens=4096, lease_s=5)  # pool: 1024

    async def run() -> tuple[int, int]:
        before = (await decode.reserve(too_big)).progress
        chunks = await pd_generate(hosts, "ends")
        refused = await decode.reserve(too_big)
        assert not refused.ok
        return before, refused.progress, sum(len(c.token_ids) for c in chunks)

    before, after, tokens = asyncio.run(run())
    assert after >= before + tokens - 1  # a step per token decoded here (the first: prefill)
    assert holds_nothing(decode.stats())


def test_cancelled_prefill_frees_its_pages(hosts: dict[str, EngineHost]) -> None:
    prefill = hosts["prefill"]

    async def run() -> None:
        long = GenerateRequest(request_id="c", prompt_ids=list(range(2000, 2600)), params=GREEDY)
        task = asyncio.create_task(prefill.prefill(attempt(long)))
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await prefill.aengine.settle()  # the abort is queued into the step loop

    asyncio.run(run())
    assert holds_nothing(prefill.stats())


def test_info_reports_what_one_sequence_can_hold(hosts: dict[str, EngineHost]) -> None:
    """The KV pool (1024 tokens) is far below the tiny model's context: it is the limit."""
    info = hosts["decode"].info()
    assert (info.kv_capacity_tokens, info.max_model_len) == (1024, 1024)


def aborted(h: EngineHost) -> float:
    """The host's ``request_success_total{finished_reason="abort"}``."""
    return sum(
        sample.value
        for family in h.metrics.m.registry.collect()
        for sample in family.samples
        if sample.name.endswith("request_success_total")
        and sample.labels.get("finished_reason") == "abort"
    )


def test_closing_a_stream_counts_each_unfinished_sequence_as_abort(
    hosts: dict[str, EngineHost],
) -> None:
    colocated = hosts["colocated"]
    params = SamplingParams(n=2, max_new_tokens=500, ignore_eos=True, seed=1)
    before = aborted(colocated)

    async def first_then_close() -> None:
        stream = colocated.generate(request("abort-me", params))
        assert not (await anext(stream)).finished
        await stream.aclose()
        await colocated.aengine.settle()  # the abort is queued into the step loop

    asyncio.run(first_then_close())
    assert aborted(colocated) == before + 2
    assert holds_nothing(colocated.stats())


def test_calls_for_another_role_are_refused(hosts: dict[str, EngineHost]) -> None:
    with pytest.raises(WrongRoleError):
        asyncio.run(
            hosts["prefill"].reserve(ReserveRequest(request_id="y", num_tokens=4, lease_s=1))
        )
    with pytest.raises(WrongRoleError):
        asyncio.run(collect(hosts["decode"].generate(request("y"))))


# ---- fenced cleanup: the release-vs-retry race -----------------------------------------


class StepGate:
    """Holds the engine's step thread right after the first step taken once ``arm`` was
    called (a prompt chunk of the retry), until ``resume`` is set: what the test queues
    meanwhile lands between two steps of a prefill in progress, as the router's late
    release did."""

    def __init__(self, engine: Engine) -> None:
        self.paused, self.resume = threading.Event(), threading.Event()
        self._armed = False
        real = engine.step

        def gated():  # noqa: ANN202 - Engine.step's own signature
            outputs = real()
            if self._armed:
                self._armed = False
                self.paused.set()
                assert self.resume.wait(60), "the test never resumed the step thread"
            return outputs

        engine.step = gated

    def arm(self) -> None:
        """Hold the step thread after the next step."""
        self.paused, self.resume = threading.Event(), threading.Event()
        self._armed = True


@pytest.fixture(scope="module")
def chunked_prefill() -> tuple[EngineHost, StepGate]:
    """A prefill host whose 37-token prompts take three steps (16-token chunks)."""
    h = host("prefill", {"chunked_prefill_size": 16})
    return h, StepGate(h.engine)


@pytest.mark.parametrize("earlier_try", ["on another replica", "staged here", "prefilling here"])
def test_release_of_an_earlier_try_never_touches_the_retry_mid_prefill(
    hosts: dict[str, EngineHost],
    chunked_prefill: tuple[EngineHost, StepGate],
    earlier_try: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The router gave up on try 0 of a request and retried it (try 1) on this replica;
    try 0's release arrives while try 1 is between two prompt chunks. The release names
    try 0 only: try 1 prefills and stages as if nothing happened, try 0's pages (if here)
    are freed, the engine stays alive, and nothing is left once try 1 is released."""
    prefill, gate = chunked_prefill
    req = request(f"race-{earlier_try.split()[0]}")
    try0, try1 = attempt(req, 0), attempt(req, 1)

    async def run() -> tuple[object, object]:
        earlier = None
        if earlier_try == "staged here":
            assert (await prefill.prefill(try0)).kv is not None
        gate.arm()
        if earlier_try == "prefilling here":
            earlier = asyncio.create_task(prefill.prefill(try0))
        retry = asyncio.create_task(prefill.prefill(try1))
        assert await asyncio.to_thread(gate.paused.wait, 60)  # try 1 is mid-prefill
        release = asyncio.create_task(prefill.release_kv(try0.attempt_id))
        await asyncio.sleep(0)  # one event-loop turn: the release is queued
        gate.resume.set()
        result = await retry
        await release
        return result, None if earlier is None else await earlier

    with caplog.at_level(logging.DEBUG, logger="workers.staging"):
        result, earlier = asyncio.run(asyncio.wait_for(run(), 120))
    prefill.check_health()  # the engine loop is alive
    assert result.kv is not None and result.kv.request_id == try1.attempt_id
    assert result.first.request_id == req.request_id and not result.first.error
    colocated = asyncio.run(collect(hosts["colocated"].generate(req)))
    assert result.first.token_ids == colocated[0].token_ids[:1]
    if earlier is not None:  # try 0 was aborted by its release: nothing staged
        assert earlier.kv is None and earlier.first.error_status == 503
    unknown = [r for r in caplog.records if "no such attempt" in r.getMessage()]
    assert bool(unknown) == (earlier_try == "on another replica")
    assert prefill.stats().staged_kv == 1 and prefill.stats().live_requests == 1
    asyncio.run(prefill.release_kv(try1.attempt_id))
    assert holds_nothing(prefill.stats())


def test_a_released_attempt_that_arrives_late_stages_nothing(
    hosts: dict[str, EngineHost],
) -> None:
    prefill, req = hosts["prefill"], request("late")
    late = attempt(req)

    async def run() -> object:
        await prefill.release_kv(late.attempt_id)  # the router gave up before it arrived
        return await prefill.prefill(late)

    result = asyncio.run(run())
    assert result.kv is None and result.first.error_status == 503
    assert "released" in (result.first.error or "")
    assert holds_nothing(prefill.stats())


def test_autoscaling_stats_follow_the_prefills_and_streams_run(
    hosts: dict[str, EngineHost],
) -> None:
    """What each role reports to Serve's autoscaler (workers/autoscale_stats.py): after a
    PD request, prefill holds no queued tokens and has measured its TTFT part and
    throughput; decode has measured gaps between its chunks and reports its KV usage."""
    chunks = asyncio.run(pd_generate(hosts, "autoscale"))
    assert len(chunks) > 2
    prefill = hosts["prefill"].autoscale.snapshot(hosts["prefill"].load())
    assert prefill["queued_prompt_tokens"] == 0
    assert prefill["ttft_p99_s"] > 0 and prefill["prefill_tokens_per_s"] > 0
    decode = hosts["decode"].autoscale.snapshot(hosts["decode"].load())
    assert decode["itl_p99_s"] > 0
    assert 0 <= decode["kv_usage"] <= 1 and decode["running"] == 0
