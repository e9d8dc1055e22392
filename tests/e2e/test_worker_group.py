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
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import openai
import pytest
import ray
from ray import serve
from serving_util import (
    TINY_ENGINE,
    ServeCluster,
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
from workers.group import rank_actor_name

APP = "group"
MAX_TOKENS = 8
PROMPTS = {
    "one": "Two ranks, one answer.",
    "left": "Which rank holds my cache?",
    "right": "Experts travel; attention stays home.",
}
TP2 = {"tp_size": 2}
FAIL_WITHIN_S = 90.0  # a dead rank fails the in-flight stream within this
RECOVER_WITHIN_S = 240.0  # Serve's health check replaces the replica within this
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
def app_url(tiny_bf16_dir: Path, serve_cluster: ServeCluster) -> Iterator[str]:
    cfg = serving_config(
        mode="pd",
        engine=engine_fields(tiny_bf16_dir),
        prefill={"num_cpus": 0.5, "engine": TP2},
        decode={"num_cpus": 0.5, "engine": DP2_EP2},
        # the failure path of a group is under test here: a lost decode stream fails
        # instead of migrating (migration: tests/e2e/test_serving_faults.py)
        router={"served_model_name": "tiny", "metrics_port": None, "max_decode_migrations": 0},
    )
    with running_app(serve_cluster.base, APP, cfg) as url:
        yield url


def stream_chat(url: str, prompt: str, max_tokens: int = MAX_TOKENS) -> str:
    c = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)
    stream = c.chat.completions.create(
        model="tiny", messages=messages(prompt), max_tokens=max_tokens, temperature=0, stream=True
    )
    return "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)


def serves(url: str, expected: dict[str, str]) -> bool:
    """Whether a request succeeds now, with the offline engine's text."""
    try:
        return stream_chat(url, PROMPTS["left"]) == expected["left"]
    except openai.APIError:
        return False


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


def rank_actor(deployment: str, rank: int) -> Any:
    """The live follower actor of rank ``rank`` of ``deployment``'s replica's group."""
    prefix = rank_actor_name(f"{APP}/{deployment}/", rank)
    for actor in ray.util.list_named_actors(all_namespaces=True):
        if actor["name"].startswith(prefix):
            try:
                return ray.get_actor(actor["name"], namespace=actor["namespace"])
            except ValueError:  # listed, then gone before the lookup (a dying replica's)
                continue
    raise LookupError(f"no live actor named {prefix}*")


def test_a_dead_decode_rank_fails_the_stream_and_the_replica_is_replaced(
    app_url: str, expected: dict[str, str]
) -> None:
    started, result = threading.Event(), {}

    def long_stream() -> None:
        c = openai.OpenAI(base_url=f"{app_url}/v1", api_key="none", max_retries=0, timeout=300)
        stream = c.chat.completions.create(
            model="tiny",
            messages=messages(PROMPTS["one"]),
            max_tokens=4000,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        try:
            for _ in stream:
                started.set()
            result["finished"] = True
        except openai.APIError as exc:
            result["error"] = exc
        result["at"] = time.monotonic()

    thread = threading.Thread(target=long_stream)
    thread.start()
    assert started.wait(120), "the stream never started"
    killed_at = time.monotonic()
    ray.kill(rank_actor("decode-0", 1), no_restart=True)
    thread.join(timeout=FAIL_WITHIN_S)
    assert not thread.is_alive(), f"the stream hung for {FAIL_WITHIN_S} s after rank 1 died"
    assert "error" in result, result
    assert result["at"] - killed_at < FAIL_WITHIN_S

    assert "engine step failed" in str(result["error"]), result  # the worker's 503, in-band
    assert wait_until(lambda: serves(app_url, expected), RECOVER_WITHIN_S, 2), "no recovery"
    assert wait_until(nothing_held, 10)


def test_an_idle_prefill_rank_that_dies_is_replaced_without_traffic(
    app_url: str, expected: dict[str, str]
) -> None:
    """No request notices the death: the health check alone has the replica replaced."""
    dead = rank_actor("prefill-0", 1)
    old_id = dead._actor_id
    ray.kill(dead, no_restart=True)

    def replaced() -> bool:
        try:
            return rank_actor("prefill-0", 1)._actor_id != old_id
        except LookupError:
            return False

    assert wait_until(replaced, RECOVER_WITHIN_S, 1), "the replica kept its dead rank"
    assert wait_until(lambda: serves(app_url, expected), RECOVER_WITHIN_S, 2), "no recovery"
    assert wait_until(nothing_held, 10)
