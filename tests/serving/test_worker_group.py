"""Worker groups of two ranks on a real local Ray cluster (gloo on CPU).

Each replica is rank 0 of a placement group of two bundles; rank 1 is a Ray actor on the
other bundle, driven in lockstep over torch.distributed. The PD app with two-rank prefill
and decode groups must answer exactly as the offline engine does, and every rank's KV
pool must hold the same bytes afterwards (the imported KV included).
"""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest
from ray import serve
from serving_util import (
    TINY_ENGINE,
    holds_nothing,
    local_serve,
    running_app,
    serving_config,
    worker_stats,
)

from dsv3serve.engine.config import EngineConfig
from dsv3serve.engine.engine import Engine
from dsv3serve.engine.request import Request
from dsv3serve.engine.sampling_params import SamplingParams

APP = "group"
MESSAGES = [{"role": "user", "content": "Two ranks, one answer."}]


@pytest.fixture(scope="module")
def app_url() -> Iterator[str]:
    group = {"num_cpus": 0.5, "group_size": 2}
    cfg = serving_config(mode="pd", prefill=group, decode=group)
    with local_serve() as base, running_app(base, APP, cfg) as url:
        yield url


def test_two_rank_groups_serve_like_the_offline_engine_and_stay_in_sync(app_url: str) -> None:
    engine = Engine(EngineConfig(**TINY_ENGINE))
    ids = engine.tokenizer.encode_chat(MESSAGES, True)
    engine.add_request(
        Request("r", SamplingParams(temperature=0, max_new_tokens=16), prompt_ids=ids)
    )
    expected = ""
    while engine.has_unfinished():
        expected += "".join(out.text for out in engine.step())

    c = openai.OpenAI(base_url=f"{app_url}/v1", api_key="none", max_retries=0, timeout=120)
    reply = c.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=16, temperature=0)
    assert reply.choices[0].message.content == expected
    for worker in ("prefill-0", "decode-0"):
        stats = worker_stats(APP, worker)
        assert stats.group_size == 2 and holds_nothing(stats)
        handle = serve.get_deployment_handle(worker, app_name=APP)
        assert handle.group_in_sync.remote().result() is True
