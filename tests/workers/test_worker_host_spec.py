"""Worker hosts without Ray: speculative decoding (MTP) across the PD handoff; the draft
state crosses the wire, or its absence is refused."""

from __future__ import annotations

import asyncio

import pytest
from serving_util import holds_nothing
from spec_util import scratch_drafts
from worker_host_util import (
    PROMPT,
    SPEC,
    collect,
    flat,
    handoff,
    host,
    pd_hosts,
    request,
)

from dsv3serve.engine.engine import Engine
from dsv3serve.sampling.sampling_params import SamplingParams
from workers.host import EngineHost
from workers.protocol import (
    DraftHandoff,
    GenerateRequest,
    TokenChunk,
)


@pytest.fixture(scope="module")
def hosts() -> dict[str, EngineHost]:
    return pd_hosts()


@pytest.fixture(scope="module")
def spec_hosts() -> dict[str, EngineHost]:
    """A prefill and a decode host with MTP speculative decoding (NextN, 2 steps)."""
    return {"prefill": host("prefill", SPEC), "decode": host("decode", SPEC)}


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
