"""Overlapped KV transfer through the live PD app: real local Ray, real HTTP, the official
``openai`` client. A prompt of several prefill chunks gives the greedy text of the engine
alone with the transfer overlapped (shm, torch_dist) and not (shm); the decode replica
counts the pages it pulled while the prefill ran, and nothing is held afterwards. When a
range pull fails, the handoff pulls the ranges it missed: same text, no migration."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from serving_util import (
    TINY_ENGINE,
    ServeCluster,
    free_port,
    holds_nothing,
    running_app,
    serving_config,
    wait_until,
    worker_stats,
)

from dsv3serve.engine.config import EngineConfig
from dsv3serve.engine.engine import Engine
from dsv3serve.engine.request import Request
from dsv3serve.sampling.sampling_params import SamplingParams

CHUNKED = {**TINY_ENGINE, "chunked_prefill_size": 64}
ON, OFF, ON_TORCH_DIST, FAILING = "ovon", "ovoff", "ovtd", "ovfail"
WORKERS = ("prefill-0", "decode-0")
SEA = "the tides, the currents, the waves, the salt, the reefs, the whales and the storms"
MESSAGES = [{"role": "user", "content": "Describe, one by one and at length, " + SEA * 20}]
MAX_TOKENS = 12
FAILING_METRICS_PORT = free_port()


@pytest.fixture(scope="module")
def apps(serve_cluster: ServeCluster) -> Iterator[dict[str, str]]:
    with (
        running_app(serve_cluster.base, ON, serving_config(engine=CHUNKED)) as on,
        running_app(
            serve_cluster.base, OFF, serving_config(engine=CHUNKED, kv_transfer_overlap=False)
        ) as off,
        running_app(
            serve_cluster.base,
            ON_TORCH_DIST,
            serving_config(engine=CHUNKED, kv_connector="torch_dist"),
        ) as td,
        running_app(
            serve_cluster.base,
            FAILING,
            serving_config(
                engine=CHUNKED,
                test_fail_range_pulls=1,
                router={"metrics_port": FAILING_METRICS_PORT},
            ),
        ) as bad,
    ):
        yield {ON: on, OFF: off, ON_TORCH_DIST: td, FAILING: bad}


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


def stream_text(base_url: str) -> str:
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0, timeout=60)
    stream = client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0, stream=True
    )
    return "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)


@pytest.mark.parametrize("app", [ON, OFF, ON_TORCH_DIST])
def test_a_long_prompt_gives_the_engine_text_and_counts_overlapped_pages(
    apps: dict[str, str], expected_text: str, app: str
) -> None:
    before = worker_stats(app, "decode-0")
    assert stream_text(apps[app]) == expected_text
    after = worker_stats(app, "decode-0")
    overlapped = after.overlapped_pages - before.overlapped_pages
    pulled = after.pulled_pages - before.pulled_pages
    if app == OFF:
        assert overlapped == 0 and pulled > 0
    else:
        assert 0 < overlapped < pulled
    assert all(wait_until(lambda w=w: holds_nothing(worker_stats(app, w)), 5) for w in WORKERS)


def migrations() -> float:
    """The FAILING app's router's ``decode_migrations_total``."""
    text = httpx.get(f"http://127.0.0.1:{FAILING_METRICS_PORT}/metrics", timeout=30).text
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name.endswith("decode_migrations_total")
    )


def test_a_failed_range_pull_is_made_up_at_the_handoff(
    apps: dict[str, str], expected_text: str
) -> None:
    """The decode replica fails its first range pull: the later ranges are not sent while
    the prefill runs, the handoff names them and decode pulls them with the final pages.
    Nothing moved overlapped, every prompt page moved once, the stream did not migrate
    (the handoff used to fail, the decode replica marked down) and the text is the
    engine's."""
    before, migrated = worker_stats(FAILING, "decode-0"), migrations()
    assert stream_text(apps[FAILING]) == expected_text
    after = worker_stats(FAILING, "decode-0")
    assert migrations() == migrated
    assert after.overlapped_pages == before.overlapped_pages
    engine = Engine(EngineConfig(**CHUNKED))
    prompt_tokens = len(engine.tokenizer.encode_chat(MESSAGES, True))
    pages = -(-prompt_tokens // CHUNKED["page_size"])
    assert after.pulled_pages - before.pulled_pages == pages
    assert all(wait_until(lambda w=w: holds_nothing(worker_stats(FAILING, w)), 5) for w in WORKERS)
