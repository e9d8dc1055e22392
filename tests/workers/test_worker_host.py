"""Worker hosts without Ray: the PD protocol, leases and error paths on real engines."""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import uuid

import pytest
from serving_util import TINY_ENGINE, holds_nothing
from spec_util import scratch_drafts

from dsv3serve.engine.config import EngineConfig
from dsv3serve.engine.engine import Engine
from dsv3serve.sampling.sampling_params import SamplingParams
from workers.config import WorkerConfig
from workers.host import EngineHost, WrongRoleError
from workers.protocol import (
    DecodeRequest,
    DraftHandoff,
    GenerateRequest,
    PrefillRequest,
    ReserveRequest,
    TokenChunk,
    encode,
)

GREEDY = SamplingParams(temperature=0, max_new_tokens=12, logprobs=1)
PROMPT = list(range(1000, 1037))
SPEC = {"speculative_algorithm": "NEXTN", "speculative_num_steps": 2}


def host(role: str, engine_extra: dict | None = None, **extra: object) -> EngineHost:
    engine = EngineConfig(**{**TINY_ENGINE, "num_kv_tokens": 1024, **(engine_extra or {})})
    return EngineHost(WorkerConfig(role=role, engine=engine, **extra))


@pytest.fixture(scope="module")
def hosts() -> dict[str, EngineHost]:
    return {
        "prefill": host("prefill", kv_lease_s=0.5),
        "decode": host("decode"),
        "colocated": host("colocated"),
    }


@pytest.fixture(scope="module")
def spec_hosts() -> dict[str, EngineHost]:
    """A prefill and a decode host with MTP speculative decoding (NextN, 2 steps)."""
    return {"prefill": host("prefill", SPEC), "decode": host("decode", SPEC)}


async def collect(stream) -> list[TokenChunk]:  # noqa: ANN001 - any async iterator
    return [chunk async for chunk in stream]


def request(rid: str, params: SamplingParams = GREEDY) -> GenerateRequest:
    return GenerateRequest(request_id=rid, prompt_ids=PROMPT, params=params)


def attempt(req: GenerateRequest, n: int = 0, tag: str | None = None) -> PrefillRequest:
    """Prefill attempt ``n`` of ``req``, named as the router names them (``tag``: the
    unique suffix; a fresh one by default, as every try of the router gets)."""
    tag = uuid.uuid4().hex[:8] if tag is None else tag
    return PrefillRequest(request=req, attempt_id=f"{req.request_id}.p{n}.{tag}")


async def handoff(
    prefill: EngineHost, decode: EngineHost, req: GenerateRequest, draft: object = "sent"
) -> list[TokenChunk]:
    """Reserve, prefill, decode and release as the router does; ``draft`` replaces the
    prefill side's draft state unless it is ``"sent"``."""
    num_tokens = len(req.prompt_ids)
    rid = req.request_id
    assert (
        await decode.reserve(ReserveRequest(request_id=rid, num_tokens=num_tokens, lease_s=5))
    ).ok
    result = await prefill.prefill(attempt(req))
    assert result.kv is not None and result.kv.num_tokens == num_tokens
    first = result.first
    msg = DecodeRequest(
        request=req,
        first_token=first.token_ids[0],
        first_logprob=first.logprobs[0] if first.logprobs else 0.0,
        first_top_logprobs=first.top_logprobs[0] if first.top_logprobs else [],
        kv=result.kv,
        draft=result.draft if draft == "sent" else draft,
    )
    chunks = await collect(decode.decode(msg))
    await prefill.release_kv(result.kv.request_id)  # the attempt id
    return chunks


async def pd_generate(hosts: dict[str, EngineHost], rid: str) -> list[TokenChunk]:
    return await handoff(hosts["prefill"], hosts["decode"], request(rid))


def flat(chunks: list[TokenChunk], key: str) -> list[object]:
    return [x for c in chunks for x in getattr(c, key)]


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


# ---- speculative decoding (MTP) across the handoff ----------------------------------


def record_first_drafts(engine: Engine) -> dict[str, tuple[list[int], list[int]]]:
    """Wrap ``engine``'s draft chain: each sequence's first (context, drafts) is kept."""
    chain, first = engine.spec.propose, {}

    def recording(items):  # noqa: ANN001, ANN202 - the wrapped method's own signature
        drafts = chain(items)
        for item in items:
            if item.seq_id in drafts:
                first.setdefault(item.seq_id, (item.seq.all_token_ids, drafts[item.seq_id]))
        return drafts

    engine.spec.propose = recording
    return first


def test_speculative_pd_equals_plain_colocated_and_drafts_at_once(
    hosts: dict[str, EngineHost], spec_hosts: dict[str, EngineHost]
) -> None:
    """The draft state crosses the wire bit-exact: the first decode step drafts at once,
    what the NextN layer recomputed from scratch would draft; outputs stay lossless."""
    decode = spec_hosts["decode"]
    first_drafts = record_first_drafts(decode.engine)
    drafted = decode.engine.spec_stats.draft_tokens
    params = SamplingParams(temperature=0, max_new_tokens=10, ignore_eos=True, logprobs=1)
    reqs = [
        GenerateRequest(request_id=f"s{i}", prompt_ids=ids, params=params)
        for i, ids in enumerate([PROMPT, list(range(3000, 3005)), list(range(4000, 4070))])
    ]

    async def run() -> list[tuple[list[TokenChunk], list[TokenChunk]]]:
        spec_prefill, colocated = spec_hosts["prefill"], hosts["colocated"]
        return [
            (await handoff(spec_prefill, decode, r), await collect(colocated.generate(r)))
            for r in reqs
        ]

    try:
        results = asyncio.run(run())
    finally:
        del decode.engine.spec.propose
    for req, (pd, colo) in zip(reqs, results, strict=True):
        assert flat(pd, "token_ids") == flat(colo, "token_ids")
        assert flat(pd, "logprobs") == pytest.approx(flat(colo, "logprobs"), abs=1e-4)
        context, drafts = first_drafts[f"{req.request_id}#0"]
        assert context == req.prompt_ids + pd[0].token_ids  # the step after the handoff
        assert drafts == scratch_drafts(decode.engine.runner.model, context, len(drafts))
    assert decode.engine.spec_stats.draft_tokens > drafted
    assert all(holds_nothing(h.stats()) for h in spec_hosts.values())


def test_decode_without_speculation_ignores_a_draft_state(
    hosts: dict[str, EngineHost], spec_hosts: dict[str, EngineHost]
) -> None:
    async def run() -> tuple[list[TokenChunk], list[TokenChunk]]:
        pd = await handoff(spec_hosts["prefill"], hosts["decode"], request("i"))
        return pd, await collect(hosts["colocated"].generate(request("i")))

    pd, colo = asyncio.run(run())
    assert flat(pd, "token_ids") == flat(colo, "token_ids")
    assert holds_nothing(hosts["decode"].stats()) and holds_nothing(spec_hosts["prefill"].stats())


FOREIGN_DRAFT = DraftHandoff(token=1, dtype="float32", shape=[3], hidden=bytes(12))


@pytest.mark.parametrize(
    ("prefill_role", "draft", "message"),
    [
        ("plain", "sent", "the prefill side sent no draft state"),
        ("spec", None, "the prefill side sent no draft state"),
        ("spec", FOREIGN_DRAFT, "found shape [3], expected ["),
    ],
)
def test_speculative_decode_refuses_a_missing_or_foreign_draft_state(
    hosts: dict[str, EngineHost],
    spec_hosts: dict[str, EngineHost],
    prefill_role: str,
    draft: object,
    message: str,
) -> None:
    """Without the prefill side's draft state the draft layer's KV of the prompt was
    never written: a 503 chunk, and neither side keeps anything."""
    prefill = hosts["prefill"] if prefill_role == "plain" else spec_hosts["prefill"]
    chunks = asyncio.run(handoff(prefill, spec_hosts["decode"], request("m"), draft))
    assert len(chunks) == 1 and chunks[0].finished and chunks[0].error_status == 503
    assert message in (chunks[0].error or "")
    assert holds_nothing(prefill.stats()) and holds_nothing(spec_hosts["decode"].stats())


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


# ---- decode-side prefix reuse -------------------------------------------------------


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
    assert reply_one == {"ok": True, "num_pages": 5, "cached_pages": 0, "dp_rank": 0}
    assert reply_two == {"ok": True, "num_pages": 1, "cached_pages": 4, "dp_rank": 0}
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
