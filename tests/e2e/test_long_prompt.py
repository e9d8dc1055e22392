"""A prompt of 90 % of the context on the default CPU app, with a short request beside it.

The default app (``dsv3serve serve``: ``router.launch``'s args) on the tiny model takes
about a minute of CPU for the prefill of such a prompt. The prefill time-out follows the
replica's progress (``router.pd.prefill_watch``), so neither the long request nor a short one
queued behind it fails while the replica is busy.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
from serving_util import ServeCluster, running_app, wait_until, worker_stats

from router.config import ServingConfig
from router.launch import local_pd_config

APP = "long"


@pytest.fixture(scope="module")
def app(serve_cluster: ServeCluster) -> Iterator[tuple[str, int]]:
    args = local_pd_config()["applications"][0]["args"]
    args["router"] |= {"num_replicas": 1, "metrics_port": None}
    cfg = ServingConfig.parse(args)
    context = cfg.engine.num_kv_tokens
    with running_app(serve_cluster.base, APP, cfg) as url:
        yield url, context


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=900)


def complete(url: str, model: str, prompt: list[int] | str) -> str:
    reply = client(url).completions.create(model=model, prompt=prompt, max_tokens=2, temperature=0)
    return reply.choices[0].finish_reason


def test_a_prompt_of_ninety_percent_of_the_context_and_a_short_one_beside_it(
    app: tuple[str, int],
) -> None:
    url, context = app
    model = client(url).models.list().data[0].id
    rng = random.Random(0)
    prompt = [rng.randrange(1000, 100000) for _ in range(context * 9 // 10)]
    with ThreadPoolExecutor(1) as pool:
        long = pool.submit(complete, url, model, prompt)
        assert wait_until(lambda: worker_stats(APP, "prefill-0").live_requests > 0, 600)
        assert complete(url, model, "Hi") == "length"  # queued behind the long prefill
        assert long.result() == "length"
    # each prefill ran in one try: none was given up (a retry could hide that: it reuses
    # the given-up try's cached prefix)
    assert worker_stats(APP, "prefill-0").cancelled_prefills == 0
