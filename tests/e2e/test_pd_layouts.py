"""PD between different parallel layouts, on a real local Ray cluster over real HTTP.

Two apps, one after the other (a module fixture per layout): prefill TP2 -> decode DP2
(DP attention with ``ep_size`` 1: each rank holds every expert whole), and prefill on one
rank -> decode DP2 + EP2 (tests/e2e/test_worker_group.py has TP2 -> DP2 + EP2). The
MLA latent cache is not split by heads, so the prefill side's pages (from one rank, or TP
rank 0) land whole on the decode DP rank that holds the reservation. Greedy text through
the official ``openai`` client, streamed and not, must equal the single-rank offline
engine's; a client that hangs up while its request prefills, while its KV moves, or while
it decodes must leave nothing held on either side (pages, reservations and their prefix
locks, staged KV), long before any lease would have freed it.

Fault injection makes the phases wide enough to hit: every prefill waits
``test_prefill_delay_s`` and every decode pull ``test_receive_delay_s`` before it copies.
The checkpoint is the bf16 tiny one run in float32 (its fp8 blocks cannot split over two
ranks), as in tests/e2e/test_worker_group.py.
"""

from __future__ import annotations

import json
import socket
import time
import urllib.parse
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
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

DP2 = {"tp_size": 2, "dp_size": 2, "enable_dp_attention": True}
DP2_EP2 = DP2 | {"ep_size": 2}
LAYOUTS: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {  # name: (prefill, decode)
    "tp2-to-dp2": ({"tp_size": 2}, DP2),
    "one-to-dp2ep2": ({}, DP2_EP2),
}
WORKERS = ("prefill-0", "decode-0")
MAX_TOKENS = 8
PROMPTS = {
    "one": "Pages cross layouts.",
    "left": "Which rank holds my cache?",
    "right": "Experts travel; attention stays home.",
}
PREFILL_DELAY_S = 2.0
RECEIVE_DELAY_S = 2.0
LEASE_S = 60.0  # staged KV; a decode reservation's lease is longer (router/pd/backend.py)
FREED_WITHIN_S = 15.0  # well inside every lease: the abort freed it, not a lease


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


@pytest.fixture(scope="module", params=list(LAYOUTS))
def app(
    request: pytest.FixtureRequest, tiny_bf16_dir: Path, serve_cluster: ServeCluster
) -> Iterator[tuple[str, str]]:
    """(app name, URL) of a PD app whose prefill and decode run the layouts ``param``."""
    name = request.param
    prefill, decode = LAYOUTS[name]
    cfg = serving_config(
        mode="pd",
        engine=engine_fields(tiny_bf16_dir),
        prefill={"num_cpus": 0.5, "engine": prefill},
        decode={"num_cpus": 0.5, "engine": decode},
        kv_lease_s=LEASE_S,
        test_prefill_delay_s=PREFILL_DELAY_S,
        test_receive_delay_s=RECEIVE_DELAY_S,
        router={"served_model_name": "tiny", "metrics_port": None, "prefill_timeout_s": 60},
    )
    with running_app(serve_cluster.base, name, cfg) as url:
        yield name, url


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=180)


def stream_chat(url: str, prompt: str) -> str:
    stream = client(url).chat.completions.create(
        model="tiny", messages=messages(prompt), max_tokens=MAX_TOKENS, temperature=0, stream=True
    )
    return "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)


def nothing_held(name: str) -> bool:
    return all(holds_nothing(worker_stats(name, w)) for w in WORKERS)


def held(name: str) -> list[Any]:
    return [worker_stats(name, w) for w in WORKERS]


def kv_digests(name: str) -> list[list[float]]:
    return serve.get_deployment_handle("decode-0", app_name=name).kv_digests.remote().result()


def test_greedy_text_streamed_and_whole_equals_the_single_engine(
    app: tuple[str, str], expected: dict[str, str]
) -> None:
    name, url = app
    before = kv_digests(name)
    assert stream_chat(url, PROMPTS["one"]) == expected["one"]
    after = kv_digests(name)
    assert after[0] != before[0] and after[1] == before[1], "an idle DP group imports on rank 0"
    whole = client(url).chat.completions.create(
        model="tiny", messages=messages(PROMPTS["one"]), max_tokens=MAX_TOKENS, temperature=0
    )
    assert whole.choices[0].message.content == expected["one"]
    assert whole.usage.completion_tokens == MAX_TOKENS
    assert wait_until(lambda: nothing_held(name), FREED_WITHIN_S), held(name)


def test_concurrent_requests_land_on_both_decode_ranks(
    app: tuple[str, str], expected: dict[str, str]
) -> None:
    name, url = app
    before, placed_before = kv_digests(name), worker_stats(name, "decode-0").rank_requests
    with ThreadPoolExecutor(2) as pool:
        texts = list(pool.map(lambda rid: stream_chat(url, PROMPTS[rid]), ("left", "right")))
    assert texts == [expected["left"], expected["right"]]
    after = kv_digests(name)
    placed = worker_stats(name, "decode-0")
    assert after[0] != before[0] and after[1] != before[1], (
        f"one DP rank took both requests: placed {placed_before} -> {placed.rank_requests}, "
        f"fallbacks {placed.rank_fallbacks}"
    )
    assert wait_until(lambda: nothing_held(name), FREED_WITHIN_S), held(name)


# ---- a client that hangs up at each phase ------------------------------------------------


def decode_in_transfer(name: str) -> float:
    """The decode replica's ``num_requests_in_transfer`` gauge (its Prometheus text)."""
    text = serve.get_deployment_handle("decode-0", app_name=name).metrics.remote().result()
    for family in text_string_to_metric_families(text.decode()):
        if family.name == "dsv3serve:num_requests_in_transfer":
            return sum(sample.value for sample in family.samples)
    raise LookupError("no dsv3serve:num_requests_in_transfer in the decode replica's metrics")


def hang_up_when(url: str, prompt: str, ready: Callable[[], bool]) -> float:
    """Send a streamed chat on a raw socket, close it once ``ready()``; the time it closed.

    A raw socket, since an HTTP client blocks until the response headers, which the router
    sends only with the first token (after the transfer).
    """
    body = json.dumps(
        {"model": "tiny", "messages": messages(prompt), "max_tokens": 4000, "stream": True}
        | {"ignore_eos": True}
    ).encode()
    parts = urllib.parse.urlsplit(f"{url}/v1/chat/completions")
    head = (
        f"POST {parts.path} HTTP/1.1\r\nHost: {parts.netloc}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    with socket.create_connection((parts.hostname, parts.port), timeout=10) as sock:
        sock.sendall(head.encode() + body)
        assert wait_until(ready, 60, 0.05), "the request never reached the phase"
    return time.monotonic()


def test_hang_up_during_prefill_frees_both_sides(app: tuple[str, str]) -> None:
    """The decode reservation exists from before the prefill until the pull: hanging up
    then leaves the request inside its ``test_prefill_delay_s``."""
    name, url = app
    reserved = lambda: worker_stats(name, "decode-0").reservations == 1  # noqa: E731
    hung_up = hang_up_when(url, PROMPTS["left"], reserved)
    assert worker_stats(name, "decode-0").live_requests == 0  # not past the prefill
    assert wait_until(lambda: nothing_held(name), FREED_WITHIN_S), held(name)
    time.sleep(PREFILL_DELAY_S)  # past the point where an unaborted prefill would stage
    assert nothing_held(name), held(name)
    assert time.monotonic() - hung_up < LEASE_S


def test_hang_up_during_the_transfer_frees_both_sides(app: tuple[str, str]) -> None:
    name, url = app
    hung_up = hang_up_when(url, PROMPTS["right"], lambda: decode_in_transfer(name) == 1)
    assert wait_until(lambda: nothing_held(name), FREED_WITHIN_S), held(name)
    assert decode_in_transfer(name) == 0
    assert time.monotonic() - hung_up < LEASE_S


def test_hang_up_during_decode_frees_both_sides(app: tuple[str, str]) -> None:
    name, url = app
    body = {"model": "tiny", "messages": messages(PROMPTS["one"]), "max_tokens": 4000}
    body |= {"stream": True, "ignore_eos": True}
    with (
        httpx.Client(timeout=120) as http,
        http.stream("POST", f"{url}/v1/chat/completions", json=body) as response,
    ):
        assert response.status_code == 200
        events = 0
        for line in response.iter_lines():
            events += line.startswith("data: ")
            if events == 3:  # still reading: the request is generating on decode
                busy = worker_stats(name, "decode-0")
                assert busy.live_requests == 1 and busy.free_pages < busy.num_pages
                break
    hung_up = time.monotonic()
    assert wait_until(lambda: nothing_held(name), FREED_WITHIN_S), held(name)
    assert time.monotonic() - hung_up < LEASE_S
