"""Worker hosts without Ray: decode-side prefix reuse across the PD handoff (the reserve
names the prompt, prefill stages only the pages the decode side lacks)."""

from __future__ import annotations

import asyncio
import json

import pytest
from serving_util import holds_nothing
from worker_host_util import (
    GREEDY,
    attempt,
    collect,
    flat,
    host,
    pd_hosts,
    request,
)

from workers.host import EngineHost
from workers.protocol import (
    DecodeRequest,
    GenerateRequest,
    ReserveRequest,
    TokenChunk,
    encode,
)


@pytest.fixture(scope="module")
def hosts() -> dict[str, EngineHost]:
    return pd_hosts()


async def reusing_handoff(
    prefill: EngineHost, decode: EngineHost, req: GenerateRequest, skip: int | None = None
) -> tuple[list[TokenChunk], dict[str, object]]:
    """The router's PD path with prefix reuse: reserve naming the prompt, prefill staging
    all pages but those the decode side holds (``skip`` overrides that), decode. Returns
    the chunks and the decode side's reserve reply as it goes over the wire."""
    rid, ids = req.request_id, req.prompt_ids
    reserve = ReserveRequest(request_id=rid, num_tokens=len(ids), lease_s=5, prompt_ids=ids)
    reserved = await decode.reserve(reserve)
    assert reserved.ok
    msg = attempt(req).model_copy(update={"skip_pages": reserved.cached_pages})
    if skip is not None:
        msg = msg.model_copy(update={"skip_pages": skip})
    result = await prefill.prefill(msg)
    assert result.kv is not None and result.kv.first_page == msg.skip_pages
    first = result.first
    chunks = await collect(
        decode.decode(
            DecodeRequest(
                request=req,
                first_token=first.token_ids[0],
                first_logprob=first.logprobs[0],
                kv=result.kv,
                cached_tokens=first.cached_tokens,
            )
        )
    )
    await prefill.release_kv(msg.attempt_id)
    return chunks, json.loads(encode(reserved))


def test_a_repeated_prompt_pulls_only_its_last_page(hosts: dict[str, EngineHost]) -> None:
    """The second time a 70-token prompt comes (pages of 16), the decode side holds its
    first 4 pages: only the 5th is staged and pulled; the tokens equal colocated, and
    ``cached_tokens`` is the prefill side's own hit (64)."""
    prefill, decode = hosts["prefill"], hosts["decode"]
    req = GenerateRequest(request_id="rp", prompt_ids=list(range(5000, 5070)), params=GREEDY)
    before = decode.stats()

    async def run() -> list[tuple[list[TokenChunk], dict[str, object]]]:
        return [await reusing_handoff(prefill, decode, req) for _ in range(2)]

    (one, reply_one), (two, reply_two) = asyncio.run(run())
    after = decode.stats()
    granted = {"dp_rank": 0, "progress": 0}  # progress: only a refusal reports it
    assert reply_one == {"ok": True, "num_pages": 5, "cached_pages": 0} | granted
    assert reply_two == {"ok": True, "num_pages": 1, "cached_pages": 4} | granted
    assert after.pulled_pages - before.pulled_pages == 5 + 1
    assert after.reused_pages - before.reused_pages == 4
    assert (after.rank_requests, after.rank_fallbacks) == ([], 0)  # no DP: no placement
    colocated = asyncio.run(collect(hosts["colocated"].generate(req)))
    assert flat(one, "token_ids") == flat(two, "token_ids") == flat(colocated, "token_ids")
    assert {c.cached_tokens for c in one} == {0} and {c.cached_tokens for c in two} == {64}
    assert all(holds_nothing(h.stats()) for h in hosts.values())


def test_a_skip_past_the_prompt_is_refused_before_the_prefill(
    hosts: dict[str, EngineHost],
) -> None:
    """``skip_pages`` that leaves no page of the prompt (37 tokens in pages of 16: 3) is the
    router's bug: an in-band 500 that says what was expected, and the prefill never runs."""
    prefill = hosts["prefill"]
    before = prompt_tokens_counted(prefill)
    msg = attempt(request("skip")).model_copy(update={"skip_pages": 3})
    result = asyncio.run(prefill.prefill(msg))
    assert result.kv is None and result.first.error_status == 500
    want = "skip_pages must be in [0, 3) for a prompt of 37 tokens in pages of 16, got 3"
    assert result.first.error == want
    assert prompt_tokens_counted(prefill) == before
    assert holds_nothing(prefill.stats())


def prompt_tokens_counted(h: EngineHost) -> float:
    labels = {"role": h.cfg.role, "replica": h.cfg.role, "model": h.cfg.engine.model}
    value = h.metrics.m.registry.get_sample_value("dsv3serve:prompt_tokens_total", labels)
    assert value is not None, f"no prompt_tokens_total sample for {labels}"
    return value


def test_staged_pages_that_do_not_fit_the_reservation_are_refused(
    hosts: dict[str, EngineHost],
) -> None:
    """A prefill that stages the whole prompt for a decode side holding its first pages:
    a 503 naming the mismatch, and neither side keeps anything (the prefix lock included)."""
    prefill, decode = hosts["prefill"], hosts["decode"]
    req = GenerateRequest(request_id="mm", prompt_ids=list(range(6000, 6040)), params=GREEDY)

    async def run() -> list[TokenChunk]:
        await reusing_handoff(prefill, decode, req)
        chunks, reply = await reusing_handoff(prefill, decode, req, skip=0)
        assert reply["cached_pages"] == 2
        return chunks

    chunks = asyncio.run(run())
    assert len(chunks) == 1 and chunks[0].error_status == 503
    assert "holds the first 2 pages" in (chunks[0].error or "")
    assert holds_nothing(prefill.stats()) and holds_nothing(decode.stats())


def test_decode_prefix_reuse_off_pulls_every_page_every_time(
    hosts: dict[str, EngineHost],
) -> None:
    """``decode_prefix_reuse=False``: the same prompt twice, and the decode side claims no
    cached page either time, so prefill stages and decode pulls all 5 pages both times;
    the tokens are the ones reuse gives."""
    prefill, decode = hosts["prefill"], host("decode", decode_prefix_reuse=False)
    req = GenerateRequest(request_id="nr", prompt_ids=list(range(7000, 7070)), params=GREEDY)

    async def run() -> list[tuple[list[TokenChunk], dict[str, object]]]:
        return [await reusing_handoff(prefill, decode, req) for _ in range(2)]

    (one, reply_one), (two, reply_two) = asyncio.run(run())
    stats = decode.stats()
    assert (reply_one["cached_pages"], reply_two["cached_pages"]) == (0, 0)
    assert (stats.pulled_pages, stats.reused_pages) == (2 * 5, 0)
    colocated = asyncio.run(collect(hosts["colocated"].generate(req)))
    assert flat(one, "token_ids") == flat(two, "token_ids") == flat(colocated, "token_ids")
    assert holds_nothing(prefill.stats()) and holds_nothing(stats)
