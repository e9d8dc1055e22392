"""Down marks on prefill replicas: tried last, affinity yields, bounded waits for a return."""

from __future__ import annotations

import asyncio

from test_router_policy import replicas

from router.routing.policy import affinity_index, prefill_order
from router.routing.replica_health import ReplicaHealth


class ProbeAnswers:
    """The replica's side of the probe, set by the test: it answers once ``up`` is set."""

    def __init__(self) -> None:
        self.up = asyncio.Event()
        self.calls = 0

    async def __call__(self, _handle: object) -> bool:
        self.calls += 1
        return self.up.is_set()


def test_a_down_replica_is_tried_last_and_loses_its_affinity() -> None:
    rs = replicas(0, 0, 0)
    prompt = list(range(64))
    home = affinity_index(prompt, 64, 3)
    rs.down.add(home)
    assert rs.by_load()[-1] == home
    assert prefill_order(rs, prompt, "prefix_affinity", 64, 100)[-1] == home
    rs.down = {0, 1, 2}  # all down: load order among them
    assert rs.by_load() == [0, 1, 2]


def test_marked_down_until_a_probe_answers_and_waits_are_bounded() -> None:
    rs = replicas(0, 0)
    probe = ProbeAnswers()

    async def run() -> tuple[bool, bool, set[int], bool]:
        health = ReplicaHealth(rs, probe, interval_s=0.01)
        health.mark_down(1)
        assert rs.by_load() == [0, 1] and rs.down == {1}
        timed_out = await health.wait_up(1, 0.05)  # never answers within the bound
        probe.up.set()
        came_back = await health.wait_up(1, 30)  # returns once a probe got an answer
        return timed_out, came_back, set(rs.down), await health.wait_up(0, 0)

    timed_out, came_back, down, other = asyncio.run(run())
    assert (timed_out, came_back, down, other) == (False, True, set(), True)
    assert probe.calls >= 2


def test_a_call_that_succeeds_clears_the_mark_at_once() -> None:
    rs = replicas(0)
    probe = ProbeAnswers()

    async def run() -> bool:
        health = ReplicaHealth(rs, probe, interval_s=30)
        health.mark_down(0)
        waiter = asyncio.ensure_future(health.wait_up(0, 60))
        health.mark_up(0)
        return await waiter

    assert asyncio.run(run()) and rs.down == set()


def test_waiting_for_any_replica_ends_when_one_answers_or_at_the_bound() -> None:
    rs = replicas(0, 0)
    probe = ProbeAnswers()

    async def run() -> tuple[bool, bool, bool, bool]:
        health = ReplicaHealth(rs, probe, interval_s=0.01)
        one_up = await health.wait_any_up(0)  # replica 0 never failed
        health.mark_down(0)
        health.mark_down(1)
        timed_out = await health.wait_any_up(0.05)  # neither answers within the bound
        probe.up.set()
        came_back = await health.wait_any_up(30)  # returns once a probe got an answer
        return one_up, timed_out, came_back, len(rs.down) < 2

    assert asyncio.run(run()) == (True, False, True, True)


def test_a_replica_out_of_the_set_does_not_count_as_up() -> None:
    """Autoscaling: with the only member down and the other replica out of the set (its
    deployment at zero), no replica is up: the wait is bounded, then ends when it answers."""
    rs = replicas(0, 0)
    rs.set_members({"prefill-1": 0})
    probe = ProbeAnswers()

    async def run() -> tuple[bool, bool]:
        health = ReplicaHealth(rs, probe, 0.01)
        health.mark_down(0)
        timed_out = await health.wait_any_up(0.05)
        probe.up.set()
        return timed_out, await health.wait_any_up(30)

    assert asyncio.run(run()) == (False, True)
    rs.set_members({"prefill-0": 0})  # no member at all: none is up

    async def none_left() -> bool:
        return await ReplicaHealth(rs, probe, 0.01).wait_any_up(0.05)

    assert asyncio.run(none_left()) is False
