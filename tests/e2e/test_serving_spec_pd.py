"""MTP speculative decoding through the PD app: real Ray, real HTTP, the ``openai`` client.

Both workers of each app run NextN speculation (2 draft steps), so the prefill side hands
its draft state to decode with the KV pages. Two apps:

* ``spec``: the tiny checkpoint, whose random NextN layer never guesses right here.
  Greedy output must equal the offline engine without speculation token for token, and
  the decode replica's counters must show a draft round at every decode step but the
  last, the first step included: that step can only draft from the handed-over state.
* ``oracle``: a test checkpoint whose NextN layer always guesses right
  (``spec_util.make_oracle_draft_checkpoint``), so a step commits up to 3 tokens, which
  must reach the client intact through the handoff, the router and SSE.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from ray import serve
from schema_cases import invalid_outputs
from serving_util import (
    TINY_ENGINE,
    ServeCluster,
    holds_nothing,
    running_app,
    serving_config,
    wait_until,
    worker_stats,
)
from spec_util import make_oracle_draft_checkpoint

from dsv3serve.engine.config import EngineConfig
from dsv3serve.engine.engine import Engine
from dsv3serve.engine.request import Request
from dsv3serve.sampling.sampling_params import SamplingParams

STEPS = 2
SPEC = {"speculative_algorithm": "NEXTN", "speculative_num_steps": STEPS}
TINY, ORACLE = "spec", "oracle"
WORKERS = ("prefill-0", "decode-0")
MAX_TOKENS = 12
_rng = random.Random(7)
PROMPTS = [[_rng.randrange(2, 128000) for _ in range(n)] for n in (1, 9, 16, 41, 130)]
MESSAGES = [{"role": "user", "content": "Tell me about the sea, in detail."}]


@dataclass
class Completion:
    """One choice as the client saw it: token texts, their logprobs, tokens per event."""

    tokens: list[str]
    logprobs: list[float]
    per_event: list[int]


@pytest.fixture(scope="module")
def oracle_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_oracle_draft_checkpoint(tmp_path_factory.mktemp("oracle-draft"))


def engine_fields(app: str, oracle_dir: Path) -> dict[str, object]:
    return TINY_ENGINE if app == TINY else {**TINY_ENGINE, "model": str(oracle_dir)}


@pytest.fixture(scope="module")
def apps(oracle_dir: Path, serve_cluster: ServeCluster) -> Iterator[dict[str, str]]:
    tiny = serving_config(engine={**engine_fields(TINY, oracle_dir), **SPEC})
    oracle = serving_config(engine={**engine_fields(ORACLE, oracle_dir), **SPEC})
    with (
        running_app(serve_cluster.base, TINY, tiny) as tiny_url,
        running_app(serve_cluster.base, ORACLE, oracle) as oracle_url,
    ):
        yield {TINY: tiny_url, ORACLE: oracle_url}


@pytest.fixture(scope="module")
def reference(oracle_dir: Path) -> dict[str, list[Completion]]:
    """Each app's checkpoint offline, without speculation: greedy completions of PROMPTS."""
    return {
        app: offline_greedy(EngineConfig(**engine_fields(app, oracle_dir)))
        for app in (TINY, ORACLE)
    }


def offline_greedy(cfg: EngineConfig) -> list[Completion]:
    engine = Engine(cfg)
    params = SamplingParams(temperature=0, max_new_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
    for i, ids in enumerate(PROMPTS):
        engine.add_request(Request(f"r{i}", params, prompt_ids=ids))
    done = {f"r{i}": Completion([], [], []) for i in range(len(PROMPTS))}
    while engine.has_unfinished():
        for out in engine.step():
            c = done[out.request_id]
            c.tokens += [
                engine.tokenizer.decode([t], skip_special_tokens=False) for t in out.token_ids
            ]
            c.logprobs += out.logprobs
    return [done[f"r{i}"] for i in range(len(PROMPTS))]


async def complete(client: openai.AsyncOpenAI, ids: list[int], stream: bool) -> Completion:
    """A greedy completion of token ids, with the sampled tokens' logprobs."""
    reply = await client.completions.create(
        model="tiny",
        prompt=ids,
        max_tokens=MAX_TOKENS,
        temperature=0,
        logprobs=0,
        stream=stream,
        extra_body={"ignore_eos": True},
    )
    got = Completion([], [], [])
    events = [event async for event in reply] if stream else [reply]
    for event in events:
        lp = event.choices[0].logprobs if event.choices else None
        if lp is not None and lp.tokens:
            got.tokens += lp.tokens
            got.logprobs += lp.token_logprobs
            got.per_event.append(len(lp.tokens))
    return got


def complete_all(url: str, stream: bool) -> list[Completion]:
    """Every prompt at once (the decode replica verifies them in one batch)."""

    async def run() -> list[Completion]:
        client = openai.AsyncOpenAI(
            base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120
        )
        return await asyncio.gather(*(complete(client, ids, stream) for ids in PROMPTS))

    return asyncio.run(run())


def spec_counters(app: str, worker: str) -> dict[str, float]:
    """The replica's speculative-decoding counters, from its Prometheus exposition."""
    handle = serve.get_deployment_handle(worker, app_name=app)
    text = handle.metrics.remote().result().decode()
    names = {
        "dsv3serve:spec_decode_num_drafts_total": "rounds",
        "dsv3serve:spec_decode_num_draft_tokens_total": "draft_tokens",
        "dsv3serve:spec_decode_num_accepted_tokens_total": "accepted",
    }
    out = dict.fromkeys(names.values(), 0.0)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in names:
                out[names[sample.name]] += sample.value
    return out


def grown(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: after[k] - before[k] for k in before}


def assert_nothing_held(app: str) -> None:
    for w in WORKERS:
        assert wait_until(lambda w=w: holds_nothing(worker_stats(app, w)), 10), w


def assert_same_greedy(got: list[Completion], want: list[Completion]) -> None:
    for ids, g, w in zip(PROMPTS, got, want, strict=True):
        assert g.tokens == w.tokens, f"prompt of {len(ids)} tokens"
        assert g.logprobs == pytest.approx(w.logprobs, abs=1e-4)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_greedy_equals_the_offline_engine_without_speculation(
    apps: dict[str, str], reference: dict[str, list[Completion]], stream: bool
) -> None:
    before = {w: spec_counters(TINY, w) for w in WORKERS}
    assert_same_greedy(complete_all(apps[TINY], stream), reference[TINY])
    decoded = grown(before["decode-0"], spec_counters(TINY, "decode-0"))
    assert decoded["accepted"] == 0  # the tiny checkpoint's NextN layer is random
    # one round per decode step but the last (no room left to draft), the first included
    n = len(PROMPTS)
    assert decoded["rounds"] == n * (MAX_TOKENS - 2)
    assert decoded["draft_tokens"] == n * (STEPS * (MAX_TOKENS - 3) + 1)
    assert grown(before["prefill-0"], spec_counters(TINY, "prefill-0"))["rounds"] == 0
    assert_nothing_held(TINY)


def test_steps_of_several_tokens_reach_the_client_intact(
    apps: dict[str, str], reference: dict[str, list[Completion]]
) -> None:
    before = spec_counters(ORACLE, "decode-0")
    got = complete_all(apps[ORACLE], stream=True)
    assert_same_greedy(got, reference[ORACLE])
    # the prefill's first token, then 1 + STEPS a step (the first step drafts from the
    # handed-over state), then 1 + the one draft that fits before max_tokens
    assert all(c.per_event == [1, 3, 3, 3, 2] for c in got), [c.per_event for c in got]
    decoded = grown(before, spec_counters(ORACLE, "decode-0"))
    assert decoded["accepted"] == decoded["draft_tokens"] == len(PROMPTS) * 7
    assert_nothing_held(ORACLE)


def test_disconnect_mid_stream_frees_pages_on_both_workers(apps: dict[str, str]) -> None:
    body = {
        "model": "tiny",
        "messages": MESSAGES,
        "max_tokens": 4000,
        "stream": True,
        "ignore_eos": True,
    }
    url = f"{apps[TINY]}/v1/chat/completions"
    with httpx.Client(timeout=30) as http, http.stream("POST", url, json=body) as response:
        assert response.status_code == 200
        events = 0
        for line in response.iter_lines():
            events += line.startswith("data: ")
            if events == 3:  # still reading: the request is drafting on decode
                busy = worker_stats(TINY, "decode-0")
                assert busy.live_requests == 1 and busy.free_pages < busy.num_pages
                break
    assert_nothing_held(TINY)


@pytest.mark.parametrize("prompt", [[10**6], []], ids=["beyond-vocab", "empty"])
def test_bad_prompt_gets_a_4xx(apps: dict[str, str], prompt: list[int]) -> None:
    response = httpx.post(
        f"{apps[TINY]}/v1/completions",
        json={"model": "tiny", "prompt": prompt, "max_tokens": 4},
        timeout=30,
    )
    assert response.status_code == 400, response.text
    assert response.json()["error"]["message"]
    assert_nothing_held(TINY)


def test_json_schema_outputs_validate_with_mtp(apps: dict[str, str]) -> None:
    """Verification respects each position's grammar mask (drafts outside it are cut), on
    both sides of the handoff: 5 samples of each of the 20 schemas, temperature 1."""
    assert invalid_outputs(f"{apps[TINY]}/v1", "tiny", 5) == []
    assert_nothing_held(TINY)
