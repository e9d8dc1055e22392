"""Overlapped KV transfer through the live PD app: real local Ray, real HTTP, the official
``openai`` client. A prompt of several prefill chunks gives the greedy text of the engine
alone with the transfer overlapped (shm, torch_dist) and not (shm); the decode replica
counts the pages it pulled while the prefill ran, and nothing is held afterwards."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest
from serving_util import (
    TINY_ENGINE,
    holds_nothing,
    local_serve,
    running_app,
    serving_config,
    wait_until,
    worker_stats,
)

from dsv3serve.engine.config import EngineConfig
from dsv3serve.engine.engine import Engine
from dsv3serve.engine.request import Request
from dsv3serve.engine.sampling_params import SamplingParams

CHUNKED = {**TINY_ENGINE, "chunked_prefill_size": 64}
ON, OFF, ON_TORCH_DIST = "ovon", "ovoff", "ovtd"
WORKERS = ("prefill-0", "decode-0")
SEA = "the tides, the currents, the waves, the salt, the reefs, the whales and the storms"
MESSAGES = [{"role": "user", "content": "Describe, one by one and at length, " + SEA * 20}]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def apps() -> Iterator[dict[str, str]]:
    with (
        local_serve() as base,
        running_app(base, ON, serving_config(engine=CHUNKED)) as on,
        running_app(base, OFF, serving_config(engine=CHUNKED, kv_transfer_overlap=False)) as off,
        running_app(
            base, ON_TORCH_DIST, serving_config(engine=CHUNKED, kv_connector="torch_dist")
        ) as td,
    ):
        yield {ON: on, OFF: off, ON_TORCH_DIST: td}


@pytest.fixture(scope="module")
def expected_text() -> str:
    engine = Engine(EngineConfig(**CHUNKED))
    ids = engine.tokenizer.encode_chat(MESSAGES, True)
    assert len(ids) > 4 * CHUNKED["chunked_prefill_size"], "the prompt must span chunks"
    params = SamplingParams(temperature=0, max_new_tokens=MAX_TOKENS)
    engine.add_request(Request("offline", params, prompt_ids=ids))
    text = ""
    while engine.has_unfinished():
        text += "".join(out.text for out in engine.step())
    return text


@pytest.mark.parametrize("app", [ON, OFF, ON_TORCH_DIST])
def test_a_long_prompt_gives_the_engine_text_and_counts_overlapped_pages(
    apps: dict[str, str], expected_text: str, app: str
) -> None:
    client = openai.OpenAI(base_url=f"{apps[app]}/v1", api_key="none", max_retries=0, timeout=60)
    before = worker_stats(app, "decode-0")
    stream = client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0, stream=True
    )
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert text == expected_text
    after = worker_stats(app, "decode-0")
    overlapped = after.overlapped_pages - before.overlapped_pages
    pulled = after.pulled_pages - before.pulled_pages
    if app == OFF:
        assert overlapped == 0 and pulled > 0
    else:
        assert 0 < overlapped < pulled
    assert all(wait_until(lambda w=w: holds_nothing(worker_stats(app, w)), 5) for w in WORKERS)
