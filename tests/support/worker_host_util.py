"""Worker hosts without Ray, driven as the router drives them: tiny-engine hosts per role,
requests and prefill attempts named as the router names them, and the PD handoff."""

from __future__ import annotations

import uuid

from serving_util import TINY_ENGINE

from dsv3serve.engine.config import EngineConfig
from dsv3serve.sampling.sampling_params import SamplingParams
from workers.config import WorkerConfig
from workers.host import EngineHost
from workers.protocol import (
    DecodeRequest,
    GenerateRequest,
    PrefillRequest,
    ReserveRequest,
    TokenChunk,
)

GREEDY = SamplingParams(temperature=0, max_new_tokens=12, logprobs=1)
PROMPT = list(range(1000, 1037))
SPEC = {"speculative_algorithm": "NEXTN", "speculative_num_steps": 2}


def host(role: str, engine_extra: dict | None = None, **extra: object) -> EngineHost:
    engine = EngineConfig(**{**TINY_ENGINE, "num_kv_tokens": 1024, **(engine_extra or {})})
    return EngineHost(WorkerConfig(role=role, engine=engine, **extra))


def pd_hosts() -> dict[str, EngineHost]:
    """A prefill host (KV lease 0.5 s), a decode host and a colocated host."""
    return {
        "prefill": host("prefill", kv_lease_s=0.5),
        "decode": host("decode"),
        "colocated": host("colocated"),
    }


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
