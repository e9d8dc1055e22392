"""The autoscaled PD app on real local Ray: Serve's controller runs ``PDAutoscaler`` over
the worker deployments, the router follows them, and a decode replica stopped while its
streams run drains them (no request fails, greedy texts equal the unscaled run's).

The app starts with two decode replicas (min 1, max 2) and no load, so the policy's first
decision after its cooldown is to stop ``decode-1``; the streams are started before that,
one after another, so that the router's least-outstanding choice puts some on ``decode-1``.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import ray
from ray import serve
from serving_util import TINY_ENGINE, ServeCluster, serving_config

from router.autoscale.app import (
    MembershipWatch,
    Reading,
    autoscaling_policy,
    choosable,
    with_autoscaling_policy,
    worker_autoscaling,
    worker_count,
)
from router.autoscale.board import NAMESPACE, LeavingSet, board_name, read_leaving
from router.launch import deploy_autoscaled
from router.routing.policy import ReplicaSet

APP = "scaled"
STREAMS = 6
TOKENS = 400
COOLDOWN_S = 30.0  # from the policy's start: the streams run by then


def running(deployment: str) -> int:
    """RUNNING replicas of ``deployment`` in the app."""
    status = serve.status().applications[APP].deployments[deployment]
    return int(status.replica_states.get("RUNNING", 0))


@pytest.fixture(scope="module")
def app_url(serve_cluster: ServeCluster) -> Iterator[str]:
    cfg = serving_config(
        mode="pd",
        engine=TINY_ENGINE | {"num_kv_tokens": 65536},  # the streams' KV fits one replica
        decode={"num_cpus": 0.5, "num_replicas": 2, "min_replicas": 1, "max_replicas": 2},
        slo={
            "ttft_p99_s": 60.0,
            "itl_p99_s": 30.0,
            "cooldown_s": COOLDOWN_S,
            "metrics_interval_s": 0.5,
            "look_back_period_s": 2.0,
            "membership_period_s": 0.2,
        },
        # this router's own load: streams started one after another alternate replicas
        router={"served_model_name": "tiny", "max_in_flight": 64, "policy": "least_outstanding"},
    )
    app = {"name": APP, "route_prefix": f"/{APP}", "import_path": "router.app:build_app"}
    deploy_autoscaled([app | {"args": cfg.model_dump(mode="json")}])
    try:
        yield f"{serve_cluster.base}/{APP}"
    finally:
        serve.delete(APP)


def greedy_stream(url: str, i: int, started: threading.Event) -> str:
    c = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=600)
    stream = c.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": f"Count to {i + 2}, slowly."}],
        max_tokens=TOKENS,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    text = ""
    for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            started.set()
    return text


def test_decode_scale_down_drains_running_streams(app_url: str) -> None:
    """Streams run on both decode replicas when the policy stops ``decode-1``: every
    stream completes, with the text the same prompts give on the one replica left."""
    assert running("decode-1") == 1
    told = LeaveWatch()  # from now on: was decode-1 on the board while Serve ran it?
    told.thread.start()
    started = [threading.Event() for _ in range(STREAMS)]
    with ThreadPoolExecutor(STREAMS) as pool:
        futures = []
        for i in range(STREAMS):  # each once the last streams: they alternate decode replicas
            futures.append(pool.submit(greedy_stream, app_url, i, started[i]))
            assert started[i].wait(300)
        left_during = False
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline and not all(f.done() for f in futures):
            if "decode-1" in read_leaving(APP).leaving or running("decode-1") == 0:
                left_during = True
                break
            time.sleep(0.2)
        texts = [f.result(timeout=600) for f in futures]
    told.stop.set()
    told.thread.join()
    assert left_during, "the streams ended before decode-1 was stopped: raise TOKENS"
    assert told.seen, "the routers were not told before Serve stopped decode-1 (issue 33)"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and running("decode-1") != 0:
        time.sleep(0.5)
    assert running("decode-1") == 0 and running("decode-0") == 1
    done = [threading.Event() for _ in range(STREAMS)]
    with ThreadPoolExecutor(STREAMS) as pool:
        expected = list(pool.map(lambda i: greedy_stream(app_url, i, done[i]), range(STREAMS)))
    assert texts == expected
    states = serve.status().applications[APP].deployments["decode-1"].replica_states
    assert not any(states.values()), f"decode-1 was started again: {states}"
    # the one router replica acknowledged the latest leaving set (the policy waited on it)
    board = ray.get_actor(board_name(APP), namespace=NAMESPACE)
    acks = json.loads(ray.get(board.acked.remote(), timeout=60))
    assert list(acks.values()) == [read_leaving(APP).version], acks  # versions 1..3 at least
    assert read_leaving(APP).version >= 3  # empty, {decode-1}, empty


class LeaveWatch:
    """Samples every 0.2 s whether ``decode-1`` is published leaving while Serve still
    runs it (the policy keeps it at least ``leave_delay_s`` so: 1.4 s here)."""

    def __init__(self) -> None:
        self.seen = False
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.seen and not self.stop.wait(0.2):
            self.seen = "decode-1" in read_leaving(APP).leaving and running("decode-1") == 1


SLO = {"ttft_p99_s": 2.0, "itl_p99_s": 0.1, "cooldown_s": 5.0, "drain_timeout_s": 90.0}


def test_an_autoscaled_role_binds_max_replicas_deployments_of_zero_or_one() -> None:
    """Deployment i of a role: kept at 1 below min_replicas, started at 1 below
    num_replicas, never above 1; stopping waits drain_timeout_s."""
    cfg = serving_config(
        prefill={"num_cpus": 0.5, "num_replicas": 1, "min_replicas": 1, "max_replicas": 3},
        decode={"num_cpus": 0.5, "num_replicas": 2, "min_replicas": 1, "max_replicas": 2},
        slo=SLO,
    )
    assert (worker_count(cfg, "prefill"), worker_count(cfg, "decode")) == (3, 2)
    scaling = [worker_autoscaling(cfg, "prefill", i)["autoscaling_config"] for i in range(3)]
    assert [(s["min_replicas"], s["max_replicas"], s["initial_replicas"]) for s in scaling] == [
        (1, 1, 1),
        (0, 1, 0),
        (0, 1, 0),
    ]
    assert worker_autoscaling(cfg, "decode", 1)["autoscaling_config"]["initial_replicas"] == 1
    assert worker_autoscaling(cfg, "decode", 1)["graceful_shutdown_timeout_s"] == 90.0
    policy = autoscaling_policy(cfg)
    assert policy is not None and policy["policy_function"] == "router.autoscale.serve:PDAutoscaler"
    assert policy["policy_kwargs"]["bounds"] == {"prefill": [1, 3], "decode": [1, 2]}
    assert policy["policy_kwargs"]["cooldown_s"] == 5.0
    assert policy["policy_kwargs"]["leave_delay_s"] == 3.0  # metrics_interval_s + 1 s
    assert policy["policy_kwargs"]["drain_timeout_s"] == 90.0
    fixed = serving_config()
    assert worker_count(fixed, "decode") == 1 and autoscaling_policy(fixed) is None
    entry = {"name": "a", "args": cfg.model_dump(mode="json")}
    assert with_autoscaling_policy(entry)["autoscaling_policy"] == policy


def test_the_router_follows_which_worker_deployments_run() -> None:
    """A deployment Serve reports at 0 running replicas leaves the choice; one that runs
    again joins; names not in the reading keep their state."""
    replicas = ReplicaSet(["decode-0", "decode-1", "decode-2"], [object()] * 3)
    watch = MembershipWatch({"decode": replicas}, lambda: Reading({}), 1.0)
    watch.apply({"decode-0": 1, "decode-1": 0, "decode-2": 0, "router": 2})
    assert replicas.members() == [0]
    watch.apply({"decode-2": 1})
    assert replicas.members() == [0, 2]


def test_the_router_stops_choosing_a_leaving_deployment_while_serve_still_runs_it() -> None:
    """Serve still reports decode-1 RUNNING (the policy keeps it for its requests), but the
    policy published it leaving: it leaves the choice on the router's next step, which
    then acknowledges that set's version (after applying it); when the leave is called
    off it joins again."""
    replicas = ReplicaSet(["decode-0", "decode-1"], [object()] * 2)
    running = {"decode-0": 1, "decode-1": 1, "router": 1}
    readings = [Reading(choosable(running, {"decode-1"}), 7), Reading(choosable(running, set()), 8)]
    acks: list[tuple[int, list[int]]] = []
    watch = MembershipWatch(
        {"decode": replicas},
        lambda: readings.pop(0),
        1.0,
        ack=lambda version: acks.append((version, replicas.members())),
    )
    watch.apply({"decode-0": 1, "decode-1": 1})
    asyncio.run(watch.step())
    assert replicas.members() == [0] and acks == [(7, [0])]
    asyncio.run(watch.step())
    assert replicas.members() == [0, 1] and acks[-1] == (8, [0, 1])


def test_a_failed_membership_reading_keeps_the_members_and_acknowledges_nothing() -> None:
    replicas = ReplicaSet(["decode-0", "decode-1"], [object()] * 2)

    def fail() -> Reading:
        raise TimeoutError("controller busy")

    acks: list[int] = []
    watch = MembershipWatch({"decode": replicas}, fail, 1.0, ack=acks.append)
    asyncio.run(watch.step())
    assert replicas.members() == [0, 1] and acks == []


def test_the_leaving_set_crosses_ray_as_checked_json() -> None:
    data = LeavingSet(version=3, leaving=frozenset({"decode-1"})).model_dump_json().encode()
    assert LeavingSet.model_validate_json(data).leaving == {"decode-1"}
    with pytest.raises(ValueError):
        LeavingSet.model_validate_json(b'{"version": 1, "leaving": {"decode-1": 1}}')
