"""Routing to (replica, DP rank) in a live PD app: a real local Ray cluster, real HTTP,
the official openai client; decode is a DP-attention group of two ranks (gloo on CPU),
prefill one rank.

The router polls each replica's per-rank load and prefix-cache summary and scores every
(replica, DP rank) (``router.routing.rank_routing``); the chosen rank travels in the reserve
message and the decode group's DP scheduler places the request there. Which rank took a
request is read from the decode replica's counters (``WorkerStats.rank_requests``).

Prices here: a running request costs 64 prompt tokens, pool usage nothing; a page is 16
tokens. The engine alone (without the router's rank) would always put a request on the
rank with the longest cached prefix: the cases below show the router trading that
against load both ways.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
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
from workers.protocol import WorkerLoad, decode

APP = "dprank"
PAGE = TINY_ENGINE["page_size"]
DP2_EP2 = {"tp_size": 2, "dp_size": 2, "enable_dp_attention": True, "ep_size": 2}
ROUTER = {
    "served_model_name": "tiny",
    "metrics_port": None,
    "policy": "rank_aware",
    "rank_report_interval_s": 0.1,
    "rank_tokens_per_request": 64,
    "rank_tokens_per_pool": 0,
}
FIRST_TURN = [
    {
        "role": "user",
        "content": "Describe, one by one and at length, the tides, the currents, the "
        "waves, the salt, the reefs, the whales, the storms and the light of the open sea.",
    }
]
MAX_TOKENS = 8


def engine_fields(model_dir: Path) -> dict[str, Any]:
    return {**TINY_ENGINE, "model": str(model_dir), "dtype": "float32"}


@pytest.fixture(scope="module")
def offline(tiny_bf16_dir: Path) -> Engine:
    """The single-rank engine on the same checkpoint: the greedy reference."""
    return Engine(EngineConfig(**engine_fields(tiny_bf16_dir)))


@pytest.fixture(scope="module")
def app_url(tiny_bf16_dir: Path, serve_cluster: ServeCluster) -> Iterator[str]:
    cfg = serving_config(
        mode="pd",
        engine=engine_fields(tiny_bf16_dir),
        decode={"num_cpus": 0.5, "engine": DP2_EP2},
        router=ROUTER,
    )
    with running_app(serve_cluster.base, APP, cfg) as url:
        yield url


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=300)


def greedy(engine: Engine, prompt_ids: list[int], max_tokens: int = MAX_TOKENS) -> str:
    params = SamplingParams(temperature=0, max_new_tokens=max_tokens)
    engine.add_request(Request(f"ref{len(prompt_ids)}", params, prompt_ids=prompt_ids))
    text = ""
    while engine.has_unfinished():
        text += "".join(out.text for out in engine.step())
    return text


def ids(tok: Any, text: str) -> list[int]:
    return tok.encode(text, add_bos=False)


def decode_load() -> WorkerLoad:
    handle = serve.get_deployment_handle("decode-0", app_name=APP)
    return decode(WorkerLoad, handle.load.remote().result())


def placed() -> list[int]:
    """Requests each decode DP rank has taken so far."""
    return worker_stats(APP, "decode-0").rank_requests


class Background:
    """A long greedy stream (ignore_eos) that runs until closed: load on one rank."""

    def __init__(self, url: str, prompt: list[int]) -> None:
        self.started, self.stop = threading.Event(), threading.Event()
        self._thread = threading.Thread(target=self._run, args=(url, prompt))
        self._thread.start()
        assert self.started.wait(180), "the background stream never started"

    def _run(self, url: str, prompt: list[int]) -> None:
        stream = client(url).completions.create(
            model="tiny", prompt=prompt, max_tokens=4000, temperature=0, stream=True,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        with stream:
            for _ in stream:
                self.started.set()
                if self.stop.is_set():
                    break

    def close(self) -> None:
        self.stop.set()
        self._thread.join(60)
        assert not self._thread.is_alive()


def nothing_runs() -> bool:
    return all(r.running + r.waiting == 0 for r in decode_load().ranks)


def test_a_second_turn_lands_on_the_first_turns_rank_and_pulls_only_new_pages(
    app_url: str, offline: Engine
) -> None:
    """Turn 1 goes to rank 1 (rank 0 is busy with a background stream). With both ranks
    idle again, turn 2 (turn 1 as its prefix) follows its cache to rank 1, where idle
    ranks would tie to rank 0: it pulls only the pages rank 1 does not hold, reports
    cached tokens, and both turns stream the single-rank engine's greedy text."""
    tok = offline.tokenizer
    busy = Background(app_url, ids(tok, "An unrelated long story. " * 4))
    before = placed()
    turn1 = _chat(app_url, FIRST_TURN)
    after1 = placed()
    busy.close()
    assert after1[1] - before[1] == 1, (before, after1)
    assert wait_until(nothing_runs, 30)

    second = [*FIRST_TURN, {"role": "assistant", "content": turn1["text"]},
              {"role": "user", "content": "And the deep?"}]  # fmt: skip
    stats = worker_stats(APP, "decode-0")
    turn2 = _chat(app_url, second)
    after = worker_stats(APP, "decode-0")
    assert [a - b for a, b in zip(after.rank_requests, stats.rank_requests, strict=True)] == [0, 1]
    ids1, ids2 = (tok.encode_chat(m, True) for m in (FIRST_TURN, second))
    common = next(
        (i for i, (a, b) in enumerate(zip(ids1, ids2, strict=False)) if a != b), len(ids1)
    )
    pulled = after.pulled_pages - stats.pulled_pages
    reused = after.reused_pages - stats.reused_pages
    assert reused >= min(common, len(ids2) - 1) // PAGE > 0
    assert pulled + reused == -(-len(ids2) // PAGE)  # only the pages rank 1 lacks
    assert turn2["cached"] > 0
    assert after.rank_fallbacks == 0
    assert (turn1["text"], turn2["text"]) == (greedy(offline, ids1), greedy(offline, ids2))
    assert wait_until(lambda: holds_nothing(worker_stats(APP, "decode-0")), 10)


def _chat(url: str, messages: list[dict[str, str]]) -> dict[str, Any]:
    stream = client(url).chat.completions.create(
        model="tiny", messages=messages, max_tokens=MAX_TOKENS, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return {"text": text, "cached": chunks[-1].usage.prompt_tokens_details.cached_tokens}


def test_with_skewed_load_a_new_request_goes_to_the_idle_rank_unless_a_hit_outweighs_it(
    app_url: str, offline: Engine
) -> None:
    """Rank 0 caches a 7-page prefix, then runs a background stream (64 tokens of load).
    A prompt sharing 1 page with the cache (16 tokens < 64) goes to idle rank 1, though
    the engine alone would pick rank 0's hit; one sharing 7 pages (112 > 64) goes to
    rank 0 despite its load."""
    tok = offline.tokenizer
    shared = ids(tok, "The sea keeps its own counsel, and the tide " * 20)[: 7 * PAGE + 1]
    assert len(shared) == 7 * PAGE + 1
    assert wait_until(nothing_runs, 30)
    assert _complete(app_url, shared + ids(tok, " first")) == 0  # idle ranks: rank 0
    assert wait_until(lambda: len(decode_load().ranks[0].prefix_hashes) >= 7, 10)
    busy = Background(app_url, ids(tok, "Elsewhere, a long unrelated tale. " * 4))
    try:
        assert decode_load().ranks[0].running == 1  # the stream went to rank 0 (a tie)
        small_hit = shared[:PAGE] + ids(tok, " a different voyage entirely, far away.")
        assert _complete(app_url, small_hit) == 1
        assert wait_until(lambda: decode_load().ranks[1].running == 0, 30)
        assert _complete(app_url, shared + ids(tok, " second")) == 0
    finally:
        busy.close()
    assert worker_stats(APP, "decode-0").rank_fallbacks == 0
    assert wait_until(lambda: holds_nothing(worker_stats(APP, "decode-0")), 30)
    assert_per_rank_metrics()


def assert_per_rank_metrics() -> None:
    """The decode replica's metrics: load and prefix-cache counters per DP rank."""
    handle = serve.get_deployment_handle("decode-0", app_name=APP)
    text = handle.metrics.remote().result().decode()
    taken = placed()
    for rank in (0, 1):
        label = f'dp_rank="{rank}"'
        lines = [line for line in text.splitlines() if label in line]
        names = {line.split("{")[0] for line in lines}
        assert {
            "dsv3serve:num_requests_running",
            "dsv3serve:kv_cache_usage_perc",
            "dsv3serve:prefix_cache_hits_total",
            "dsv3serve:dp_rank_fallbacks_total",
        } <= names, names
        requests = [ln for ln in lines if ln.startswith("dsv3serve:dp_rank_requests_total")]
        assert requests and float(requests[0].rsplit(" ", 1)[1]) == taken[rank]


def _complete(url: str, prompt: list[int]) -> int:
    """Run a short greedy completion; returns the decode DP rank that took it."""
    before = placed()
    client(url).completions.create(model="tiny", prompt=prompt, max_tokens=2, temperature=0)
    after = placed()
    ranks = [r for r, (a, b) in enumerate(zip(after, before, strict=True)) if a != b]
    assert len(ranks) == 1 and after[ranks[0]] - before[ranks[0]] == 1, (before, after)
    return ranks[0]
