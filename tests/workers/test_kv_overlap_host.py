"""Overlapped KV transfer between worker hosts, without Ray: a chunked prefill stages the
pages of finished chunks as ranges, the decode host pulls each while the prefill runs,
and the handoff pulls the rest; every exit path frees everything (real engines, real
shm and torch_dist connectors)."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Iterator

import pytest
from serving_util import TINY_ENGINE, holds_nothing

from dsv3serve.engine.config import EngineConfig
from dsv3serve.sampling.sampling_params import SamplingParams
from kv_transfer.handle import KVHandle
from workers.config import WorkerConfig
from workers.host import EngineHost
from workers.protocol import (
    DecodeRequest,
    GenerateRequest,
    PrefillEvent,
    PrefillRequest,
    PrefillResult,
    PullRequest,
    ReserveRequest,
)

PAGE = TINY_ENGINE["page_size"]
CHUNK = 4 * PAGE
PROMPT_LEN = 5 * CHUNK + 7  # six chunks, 21 pages
GREEDY = SamplingParams(temperature=0, max_new_tokens=8)


def make_host(role: str, connector: str = "shm", **extra: object) -> EngineHost:
    engine = {**TINY_ENGINE, "num_kv_tokens": 2048, "chunked_prefill_size": CHUNK}
    cfg = WorkerConfig(role=role, engine=EngineConfig(**engine), kv_connector=connector, **extra)
    return EngineHost(cfg)


@pytest.fixture(scope="module", params=["shm", "torch_dist"])
def pair(request: pytest.FixtureRequest) -> Iterator[tuple[EngineHost, EngineHost]]:
    hosts = make_host("prefill", request.param), make_host("decode", request.param)
    yield hosts
    for h in hosts:
        h.close()


@pytest.fixture(scope="module")
def colocated() -> Iterator[EngineHost]:
    host = make_host("colocated")
    yield host
    host.close()


def colocated_tokens(colo: EngineHost, rid: str) -> list[int]:
    async def run() -> list[int]:
        return [t async for c in colo.generate(request(rid)) for t in c.token_ids]

    return asyncio.run(run())


def request(rid: str) -> GenerateRequest:
    """A prompt of its own per request id (a prefix-cache hit would leave one chunk)."""
    start = 3000 + 1000 * (ord(rid[0]) - ord("a")) + 97 * len(rid)
    prompt = list(range(start, start + PROMPT_LEN))
    return GenerateRequest(request_id=rid, prompt_ids=prompt, params=GREEDY)


def attempt(rid: str, k: int = 0) -> PrefillRequest:
    return PrefillRequest(request=request(rid), attempt_id=f"{rid}.p{k}.{uuid.uuid4().hex[:8]}")


async def reserve(decode: EngineHost, rid: str) -> None:
    msg = ReserveRequest(request_id=rid, num_tokens=PROMPT_LEN, lease_s=30)
    assert (await decode.reserve(msg)).ok


async def pull(decode: EngineHost, msg: PrefillRequest, kv: KVHandle) -> bool:
    rid = msg.request.request_id
    result = await decode.pull_kv(PullRequest(request_id=rid, attempt_id=msg.attempt_id, kv=kv))
    return result.ok


async def run_overlapped(
    prefill: EngineHost, decode: EngineHost, msg: PrefillRequest, pull_ranges: bool = True
) -> tuple[list[KVHandle], PrefillResult]:
    """The router's part: each range pulled as it comes (unless ``pull_ranges`` is
    False); the result."""
    ranges: list[KVHandle] = []
    async for event in prefill.prefill_stream(msg):
        if event.kv_range is not None:
            ranges.append(event.kv_range)
            if pull_ranges:
                assert await pull(decode, msg, event.kv_range)
        else:
            assert event.result is not None
            return ranges, event.result
    raise AssertionError("no result")


async def hand_off(
    decode: EngineHost,
    msg: PrefillRequest,
    result: PrefillResult,
    missed: tuple[KVHandle, ...] = (),
) -> list[int]:
    assert result.kv is not None
    first = result.first.token_ids[0]
    handoff = DecodeRequest(
        request=msg.request, first_token=first, kv=result.kv, kv_ranges=list(missed)
    )
    chunks = [c async for c in decode.decode(handoff)]
    assert not any(c.error for c in chunks), chunks
    return [t for c in chunks for t in c.token_ids]


def nothing_held(*hosts: EngineHost) -> bool:
    return all(holds_nothing(h.stats()) for h in hosts)


def test_overlapped_handoff_equals_colocated_and_frees_everything(
    pair: tuple[EngineHost, EngineHost], colocated: EngineHost
) -> None:
    prefill, decode = pair
    overlapped_before = decode.stats().overlapped_pages

    async def run() -> tuple[list[KVHandle], PrefillResult, list[int]]:
        msg = attempt("a")
        await reserve(decode, "a")
        ranges, result = await run_overlapped(prefill, decode, msg)
        tokens = await hand_off(decode, msg, result)
        await prefill.release_kv(msg.attempt_id)
        return ranges, result, tokens

    ranges, result, tokens = asyncio.run(run())
    assert tokens == colocated_tokens(colocated, "a")
    assert ranges, "no page moved while the prefill ran"
    starts = [r.first_page for r in ranges] + [result.kv.first_page]
    sizes = [r.num_pages for r in ranges] + [result.kv.num_pages]
    assert starts == [sum(sizes[:i]) for i in range(len(sizes))]  # contiguous, in order
    assert sum(sizes) == 21 and result.kv.num_pages < 21
    assert decode.stats().overlapped_pages - overlapped_before == sum(sizes[:-1])
    assert nothing_held(prefill, decode)


@pytest.mark.parametrize("missed", ["all", "last"])
def test_ranges_whose_pull_failed_are_pulled_at_the_handoff(
    pair: tuple[EngineHost, EngineHost], colocated: EngineHost, missed: str
) -> None:
    """A range the overlapped transfer did not pull (its pull failed) rides in the
    handoff (``kv_ranges``): decode pulls it before the final pages, and the text stays
    the colocated engine's (the handoff used to fail on a staged-pages mismatch)."""
    prefill, decode = pair
    before = decode.stats()
    rid = {"all": "x", "last": "y"}[missed]  # a prompt of its own (keyed by the letter)

    async def run() -> tuple[list[KVHandle], list[int]]:
        msg = attempt(rid)
        await reserve(decode, rid)
        ranges, result = await run_overlapped(prefill, decode, msg, pull_ranges=False)
        assert ranges, "no range was staged while the prefill ran"
        pulls = 0 if missed == "all" else len(ranges) - 1  # the rest: their pulls failed
        for kv in ranges[:pulls]:  # staged until the attempt is released
            assert await pull(decode, msg, kv)
        tokens = await hand_off(decode, msg, result, missed=tuple(ranges[pulls:]))
        await prefill.release_kv(msg.attempt_id)
        return ranges, tokens

    ranges, tokens = asyncio.run(run())
    pulls = 0 if missed == "all" else len(ranges) - 1
    assert tokens == colocated_tokens(colocated, rid)
    after = decode.stats()
    assert after.overlapped_pages - before.overlapped_pages == sum(
        r.num_pages for r in ranges[:pulls]
    )
    assert after.pulled_pages - before.pulled_pages == 21
    assert nothing_held(prefill, decode)


def test_a_missed_range_that_cannot_be_pulled_fails_the_handoff_and_frees_it(
    pair: tuple[EngineHost, EngineHost],
) -> None:
    """The prefill side released the attempt (its ranges with it) before the handoff: the
    missed range's pull fails, the decode side answers 503 and holds nothing."""
    prefill, decode = pair

    async def run() -> list:
        msg = attempt("z")
        await reserve(decode, "z")
        ranges, result = await run_overlapped(prefill, decode, msg, pull_ranges=False)
        assert ranges and result.kv is not None
        await prefill.release_kv(msg.attempt_id)  # as if its lease ran out
        first = result.first.token_ids[0]
        handoff = DecodeRequest(
            request=msg.request, first_token=first, kv=result.kv, kv_ranges=ranges
        )
        return [c async for c in decode.decode(handoff)]

    chunks = asyncio.run(run())
    assert len(chunks) == 1 and chunks[0].error_status == 503, chunks
    assert "KV range transfer failed" in (chunks[0].error or "")
    assert nothing_held(prefill, decode)


def test_an_abort_after_a_range_was_pulled_frees_both_sides(
    pair: tuple[EngineHost, EngineHost],
) -> None:
    prefill, decode = pair

    async def run() -> None:
        msg = attempt("b")
        await reserve(decode, "b")
        events: AsyncIterator[PrefillEvent] = prefill.prefill_stream(msg)
        event = await anext(events)
        assert event.kv_range is not None and await pull(decode, msg, event.kv_range)
        await events.aclose()  # the router gave up (client gone): the prefill is aborted
        await prefill.release_kv(msg.attempt_id)
        decode.cancel_reservation("b")
        await prefill.aengine.settle()

    asyncio.run(run())
    assert nothing_held(prefill, decode)


def test_a_reservation_given_back_mid_pull_is_freed_once_the_copy_ended() -> None:
    prefill, decode = make_host("prefill"), make_host("decode", test_receive_delay_s=0.5)

    async def run() -> None:
        msg = attempt("c")
        await reserve(decode, "c")
        events = prefill.prefill_stream(msg)
        event = await anext(events)
        assert event.kv_range is not None
        pulling = asyncio.create_task(pull(decode, msg, event.kv_range))
        await asyncio.sleep(0.2)  # the pull holds the pages (it copies after 0.5 s)
        decode.cancel_reservation("c")
        stats = decode.stats()
        assert stats.reservations == 0 and stats.free_pages < stats.num_pages  # not yet
        assert not await pulling  # the copy ended, into pages given back right after
        await events.aclose()
        await prefill.release_kv(msg.attempt_id)
        await prefill.aengine.settle()

    asyncio.run(run())
    assert nothing_held(prefill, decode)
    prefill.close()
    decode.close()


def test_a_retry_pulls_its_own_ranges_after_an_abandoned_attempt(
    pair: tuple[EngineHost, EngineHost], colocated: EngineHost
) -> None:
    """Attempt p0 lands a range, then is given up; p1 starts over in the same reservation."""
    prefill, decode = pair

    async def run() -> list[int]:
        await reserve(decode, "d")
        first_try = attempt("d", 0)
        events = prefill.prefill_stream(first_try)
        event = await anext(events)
        assert event.kv_range is not None and await pull(decode, first_try, event.kv_range)
        await events.aclose()
        await prefill.release_kv(first_try.attempt_id)
        retry = attempt("d", 1)
        ranges, result = await run_overlapped(prefill, decode, retry)
        assert ranges and ranges[0].first_page == 0
        tokens = await hand_off(decode, retry, result)
        await prefill.release_kv(retry.attempt_id)
        return tokens

    assert asyncio.run(run()) == colocated_tokens(colocated, "d")
    assert nothing_held(prefill, decode)


def test_dropped_ranges_are_staged_again_with_the_result(
    pair: tuple[EngineHost, EngineHost], colocated: EngineHost
) -> None:
    """As when the engine preempts the prefill or swaps its pages: the engine's hook drops
    the ranges; the result then holds every page and decode pulls them all again."""
    prefill, decode = pair

    async def run() -> tuple[PrefillResult, list[int]]:
        msg = attempt("e")
        await reserve(decode, "e")
        result = None
        async for event in prefill.prefill_stream(msg):
            if event.kv_range is not None:
                assert await pull(decode, msg, event.kv_range)
                await prefill.aengine.mutate(lambda _: prefill.staging.ranges.drop(msg.attempt_id))
            else:
                result = event.result
        assert result is not None
        tokens = await hand_off(decode, msg, result)
        await prefill.release_kv(msg.attempt_id)
        return result, tokens

    result, tokens = asyncio.run(run())
    assert result.kv is not None and result.kv.first_page == 0 and result.kv.num_pages == 21
    assert tokens == colocated_tokens(colocated, "e")
    assert nothing_held(prefill, decode)


def test_a_range_out_of_order_is_refused_and_keeps_the_reservation() -> None:
    decode = make_host("decode")

    async def run() -> None:
        await reserve(decode, "f")
        kv = KVHandle(
            request_id="f.p0.x.r0", connector="shm", num_tokens=PAGE, num_pages=1,
            page_size=PAGE, num_layers=1, kv_dim=576, dtype="bfloat16", nbytes=0,
            first_page=3,
        )  # fmt: skip
        result = await decode.pull_kv(PullRequest(request_id="f", attempt_id="f.p0.x", kv=kv))
        assert not result.ok and "not the next" in (result.error or "")
        assert decode.stats().reservations == 1
        decode.cancel_reservation("f")

    asyncio.run(run())
    assert nothing_held(decode)
    decode.close()


def test_the_range_stream_waits_for_steps_instead_of_spinning_before_admission() -> None:
    """While the prefill is not admitted yet (here: its fault-injected delay) no step runs,
    so nothing can become final: the stream looks again every IDLE_POLL_S instead of
    asking the step thread in a busy loop (it asked thousands of times in half a second)."""
    prefill, decode = make_host("prefill", test_prefill_delay_s=0.5), make_host("decode")
    ranges = prefill.staging.ranges
    asks = 0
    publish = ranges.publish_ready

    def counted(engine: object, attempt_id: str) -> KVHandle | None:
        nonlocal asks
        asks += 1
        return publish(engine, attempt_id)  # type: ignore[arg-type]

    ranges.publish_ready = counted  # type: ignore[method-assign]

    async def run() -> None:
        msg = attempt("g")
        await reserve(decode, "g")
        _, result = await run_overlapped(prefill, decode, msg)
        await hand_off(decode, msg, result)
        await prefill.release_kv(msg.attempt_id)

    asyncio.run(run())
    assert asks <= 3 * 6, f"{asks} asks for a prefill of 6 chunks"
    assert nothing_held(prefill, decode)
    prefill.close()
    decode.close()
