"""Worker hosts without Ray: the PD protocol, leases and error paths on real engines."""

from __future__ import annotations

import asyncio

import pytest
from serving_util import TINY_ENGINE, holds_nothing

from dsv3serve.engine.config import EngineConfig
from dsv3serve.engine.sampling_params import SamplingParams
from workers.config import WorkerConfig
from workers.host import EngineHost, WrongRoleError
from workers.protocol import (
    DecodeRequest,
    GenerateRequest,
    PrefillRequest,
    ReserveRequest,
    TokenChunk,
)

GREEDY = SamplingParams(temperature=0, max_new_tokens=12, logprobs=1)
PROMPT = list(range(1000, 1037))


def host(role: str, **extra: object) -> EngineHost:
    engine = EngineConfig(**{**TINY_ENGINE, "num_kv_tokens": 1024})
    return EngineHost(WorkerConfig(role=role, engine=engine, **extra))


@pytest.fixture(scope="module")
def hosts() -> dict[str, EngineHost]:
    return {
        "prefill": host("prefill", kv_lease_s=0.5),
        "decode": host("decode"),
        "colocated": host("colocated"),
    }


async def collect(stream) -> list[TokenChunk]:  # noqa: ANN001 - any async iterator
    return [chunk async for chunk in stream]


def request(rid: str, params: SamplingParams = GREEDY) -> GenerateRequest:
    return GenerateRequest(request_id=rid, prompt_ids=PROMPT, params=params)


async def pd_generate(hosts: dict[str, EngineHost], rid: str) -> list[TokenChunk]:
    prefill, decode = hosts["prefill"], hosts["decode"]
    reserved = decode.reserve(ReserveRequest(request_id=rid, num_tokens=len(PROMPT), lease_s=5))
    assert reserved.ok
    result = await prefill.prefill(PrefillRequest(request=request(rid)))
    assert result.kv is not None and result.kv.num_tokens == len(PROMPT)
    first = result.first
    chunks = await collect(
        decode.decode(
            DecodeRequest(
                request=request(rid),
                first_token=first.token_ids[0],
                first_logprob=first.logprobs[0],
                first_top_logprobs=first.top_logprobs[0],
                kv=result.kv,
            )
        )
    )
    prefill.release_kv(rid)
    return chunks


def test_pd_stream_equals_colocated_tokens_text_and_logprobs(hosts: dict[str, EngineHost]) -> None:
    async def run() -> tuple[list[TokenChunk], list[TokenChunk]]:
        pd = await pd_generate(hosts, "a")
        colo = await collect(hosts["colocated"].generate(request("a")))
        return pd, colo

    pd, colo = asyncio.run(run())

    def flat(chunks: list[TokenChunk], key: str) -> list[object]:
        return [x for c in chunks for x in getattr(c, key)]

    assert flat(pd, "token_ids") == flat(colo, "token_ids")
    assert "".join(c.text for c in pd) == "".join(c.text for c in colo)
    assert flat(pd, "logprobs") == pytest.approx(flat(colo, "logprobs"), abs=1e-4)
    assert pd[-1].finished and pd[-1].completion_tokens == colo[-1].completion_tokens
    for h in hosts.values():
        assert holds_nothing(h.stats())


def test_unpulled_kv_is_freed_when_its_lease_expires(hosts: dict[str, EngineHost]) -> None:
    prefill = hosts["prefill"]

    async def run() -> None:
        result = await prefill.prefill(PrefillRequest(request=request("never-pulled")))
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
        assert decode.reserve(ReserveRequest(request_id="r", num_tokens=100, lease_s=0.3)).ok
        assert decode.stats().reservations == 1
        await asyncio.sleep(0.8)

    asyncio.run(run())
    assert holds_nothing(decode.stats())


def test_decode_after_released_kv_fails_cleanly_and_frees_the_reservation(
    hosts: dict[str, EngineHost],
) -> None:
    prefill, decode = hosts["prefill"], hosts["decode"]

    async def run() -> list[TokenChunk]:
        assert decode.reserve(ReserveRequest(request_id="x", num_tokens=40, lease_s=5)).ok
        result = await prefill.prefill(PrefillRequest(request=request("x")))
        prefill.release_kv("x")  # as if the lease ran out before decode pulled
        msg = DecodeRequest(
            request=request("x"), first_token=result.first.token_ids[0], kv=result.kv
        )
        return await collect(decode.decode(msg))

    chunks = asyncio.run(run())
    assert len(chunks) == 1 and chunks[0].error and chunks[0].error_status == 503
    assert holds_nothing(decode.stats()) and holds_nothing(prefill.stats())


def test_cancelled_prefill_frees_its_pages(hosts: dict[str, EngineHost]) -> None:
    prefill = hosts["prefill"]

    async def run() -> None:
        long = GenerateRequest(request_id="c", prompt_ids=list(range(2000, 2600)), params=GREEDY)
        task = asyncio.create_task(prefill.prefill(PrefillRequest(request=long)))
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(run())
    assert holds_nothing(prefill.stats())


def test_calls_for_another_role_are_refused(hosts: dict[str, EngineHost]) -> None:
    with pytest.raises(WrongRoleError):
        hosts["prefill"].reserve(ReserveRequest(request_id="y", num_tokens=4, lease_s=1))
    with pytest.raises(WrongRoleError):
        asyncio.run(collect(hosts["decode"].generate(request("y"))))
