"""Sharded worker groups behind Ray Serve: a TP prefill group, a DP-attention decode group.

A real local Ray cluster (gloo on CPU), real HTTP and the official openai client. Each
replica is rank 0 of a placement group of two bundles; rank 1 is a Ray actor on the other
bundle. Prefill runs TP over 2 ranks (heads split), decode runs DP attention with the
experts split by EP over 2 ranks (each rank its own requests and KV pool): the app must
stream exactly the greedy text of the single-rank offline engine on the same checkpoint.

The tiny checkpoint is the bf16 one (the fp8 one's 128x128 blocks cannot split over two
ranks) run in float32.

KV placement: TP ranks hold the same latent KV, so every prefill rank's pool holds the
same bytes. DP ranks hold their own: a request imported onto decode rank 0 must leave
rank 1's pool untouched (rank 1 gets no copy), and two concurrent requests are spread
over both ranks (each reservation goes to the rank with the most room).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import openai
import pytest
from ray import serve
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

APP = "group"
MAX_TOKENS = 8
PROMPTS = {
    "one": "Two ranks, one answer.",
    "left": "Which rank holds my cache?",
    "right": "Experts travel; attention stays home.",
}
TP2 = {"tp_size": 2}
DP2_EP2 = {"tp_size": 2, "dp_size": 2, "enable_dp_attention": True, "ep_size": 2}


def engine_fields(model_dir: Path) -> dict[str, Any]:
    return {**TINY_ENGINE, "model": str(model_dir), "dtype": "float32"}


def messages(prompt: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": prompt}]


@pytest.fixture(scope="module")
def expected(tiny_bf16_dir: Path) -> dict[str, str]:
    """The single-rank offline engine's greedy text of every prompt (the reference)."""
    engine = Engine(EngineConfig(**engine_fields(tiny_bf16_dir)))
    params = SamplingParams(temperature=0, max_new_tokens=MAX_TOKENS)
    for rid, prompt in PROMPTS.items():
        ids = engine.tokenizer.encode_chat(messages(prompt), True)
        engine.add_request(Request(rid, params, prompt_ids=ids))
    texts = dict.fromkeys(PROMPTS, "")
    while engine.has_unfinished():
        for out in engine.step():
            texts[out.request_id] += out.text
    return texts


@pytest.fixture(scope="module")
def app_url(tiny_bf16_dir: Path) -> Iterator[str]:
    cfg = serving_config(
        mode="pd",
        engine=engine_fields(tiny_bf16_dir),
        prefill={"num_cpus": 0.5, "engine": TP2},
        decode={"num_cpus": 0.5, "engine": DP2_EP2},
    )
    with local_serve() as base, running_app(base, APP, cfg) as url:
        yield url


def stream_chat(url: str, prompt: str, max_tokens: int = MAX_TOKENS) -> str:
    c = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)
    stream = c.chat.completions.create(
        model="tiny", messages=messages(prompt), max_tokens=max_tokens, temperature=0, stream=True
    )
    return "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)


def kv_digests(deployment: str) -> list[list[float]]:
    handle = serve.get_deployment_handle(deployment, app_name=APP)
    return handle.kv_digests.remote().result()


def nothing_held() -> bool:
    return all(holds_nothing(worker_stats(APP, w)) for w in ("prefill-0", "decode-0"))


def test_tp_prefill_and_dp_decode_groups_stream_the_offline_engines_text(
    app_url: str, expected: dict[str, str]
) -> None:
    before = kv_digests("decode-0")
    assert stream_chat(app_url, PROMPTS["one"]) == expected["one"]
    after_one = kv_digests("decode-0")
    assert after_one[0] != before[0], "an idle DP group places the import on rank 0"
    assert after_one[1] == before[1], "rank 1 of the DP group received KV it does not own"
    prefill = serve.get_deployment_handle("prefill-0", app_name=APP)
    assert prefill.group_in_sync.remote().result() is True  # TP ranks: the same latent KV

    with ThreadPoolExecutor(2) as pool:
        both = list(pool.map(lambda rid: stream_chat(app_url, PROMPTS[rid]), ("left", "right")))
    assert both == [expected["left"], expected["right"]]
    assert kv_digests("decode-0")[1] != after_one[1], "the concurrent requests all ran on rank 0"
    assert wait_until(nothing_held, 10), [worker_stats(APP, w) for w in ("prefill-0", "decode-0")]
    for worker in ("prefill-0", "decode-0"):
        assert worker_stats(APP, worker).group_size == 2
