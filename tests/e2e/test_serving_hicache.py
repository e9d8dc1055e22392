"""The hierarchical cache in the live PD app (real local Ray, real HTTP, the official
``openai`` client): a two-turn chat whose first turn was pushed out of the KV pools by
other chats comes back from the host tier.

Two PD apps run the same traffic on pools of 16 pages: one with the host tier, one
without. Without it the second turn finds at most the page every chat shares (the chat
template's head, kept warm by the pushes), so the first turn really was evicted; with it
the prefill side loads the first turn back, reports more ``cached_tokens`` and streams
the same text, and the decode side reuses more of the prompt's pages (loaded back from its
own host tier) instead of pulling them.
"""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest
from serving_util import (
    TINY_ENGINE,
    ServeCluster,
    holds_nothing,
    running_app,
    serving_config,
    wait_until,
    worker_stats,
)

TIER, PLAIN = "hic", "nohic"
SMALL_POOL = TINY_ENGINE | {"num_kv_tokens": 256}
FIRST = [
    {
        "role": "user",
        "content": "Tell me, at length and in order, about the tides of the open sea: the "
        "spring tides and the neap tides, the moon and the sun that pull them, the bays "
        "where they run high, the shallows where they turn, and the sailors who read them.",
    }
]
PUSH = [
    f"Describe the {thing} of a {place}, one by one, with every detail you can think of: "
    f"their names, their shapes, their colours, their sounds, their ages, where they come "
    f"from, where they go, and what the people of the {place} say about the {thing}."
    for thing, place in [
        ("rivers", "valley"),
        ("birds", "forest"),
        ("stones", "desert"),
        ("winds", "mountain"),
        ("lights", "city"),
        ("roots", "jungle"),
        ("bells", "harbour"),
        ("clouds", "plain"),
    ]
]


@pytest.fixture(scope="module")
def apps(serve_cluster: ServeCluster) -> Iterator[dict[str, str]]:
    tier = SMALL_POOL | {"enable_hierarchical_cache": True, "hicache_ratio": 4.0}
    with (
        running_app(serve_cluster.base, TIER, serving_config(mode="pd", engine=tier)) as tier_url,
        running_app(
            serve_cluster.base, PLAIN, serving_config(mode="pd", engine=SMALL_POOL)
        ) as plain_url,
    ):
        yield {TIER: tier_url, PLAIN: plain_url}


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)


def _stream(url: str, messages: list[dict[str, str]]) -> tuple[str, int]:
    """Greedy streamed chat: its text and the usage's ``cached_tokens``."""
    stream = _client(url).chat.completions.create(
        model="tiny",
        messages=messages,
        max_tokens=8,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    text, cached = "", -1
    for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
        if chunk.usage is not None:
            cached = chunk.usage.prompt_tokens_details.cached_tokens
    return text, cached


def _two_turns(url: str) -> tuple[str, int, int]:
    """Turn one, chats that push it out of the pools, turn two: turn two's text, its
    ``cached_tokens``, and the decode side's reused pages during turn two."""
    reply, _ = _stream(url, FIRST)
    for content in PUSH:
        _stream(url, [{"role": "user", "content": content}])
    app = url.rsplit("/", 1)[1]
    before = worker_stats(app, "decode-0").reused_pages
    second = [*FIRST, {"role": "assistant", "content": reply}]
    second.append({"role": "user", "content": "And the currents?"})
    text, cached = _stream(url, second)
    return text, cached, worker_stats(app, "decode-0").reused_pages - before


def test_an_evicted_first_turn_comes_back_from_the_host_tier(apps: dict[str, str]) -> None:
    page = TINY_ENGINE["page_size"]
    plain_text, plain_cached, plain_reused = _two_turns(apps[PLAIN])
    assert plain_cached <= page, "the pushes must evict the first turn from a plain pool"
    text, cached, reused = _two_turns(apps[TIER])
    assert cached >= plain_cached + 2 * page and cached % page == 0
    assert reused > plain_reused, "the decode side reuses the first turn from its host tier"
    assert text == plain_text and text
    for app in (TIER, PLAIN):
        for worker in ("prefill-0", "decode-0"):
            assert wait_until(lambda a=app, w=worker: holds_nothing(worker_stats(a, w)), 10)
