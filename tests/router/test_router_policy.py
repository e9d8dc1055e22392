"""Replica choice: least outstanding tokens and prefix affinity."""

from __future__ import annotations

import random

from router.routing.policy import ReplicaSet, affinity_index, prefill_order


def replicas(*loads: int) -> ReplicaSet:
    rs = ReplicaSet([f"prefill-{i}" for i in range(len(loads))], [object() for _ in loads])
    for i, load in enumerate(loads):
        rs.acquire(i, load)
    return rs


def test_least_outstanding_orders_by_load_then_index() -> None:
    rs = replicas(30, 10, 10, 0)
    assert rs.by_load() == [3, 1, 2, 0]
    rs.release(0, 30)
    assert rs.by_load() == [0, 3, 1, 2]


def test_prefix_affinity_sends_a_shared_prefix_to_one_replica() -> None:
    rng = random.Random(5)
    prefix = [rng.randrange(128000) for _ in range(64)]
    homes = {
        affinity_index(prefix + [rng.randrange(128000) for _ in range(20)], 64, 4)
        for _ in range(20)
    }
    assert len(homes) == 1
    spread = {affinity_index([rng.randrange(128000) for _ in range(64)], 64, 4) for _ in range(200)}
    assert spread == {0, 1, 2, 3}  # different prefixes use every replica


def test_short_prompts_and_overloaded_homes_fall_back_to_load() -> None:
    rs = replicas(0, 0, 0)
    assert affinity_index([1, 2, 3], 64, 3) is None
    assert prefill_order(rs, [1, 2, 3], "prefix_affinity", 64, 100) == [0, 1, 2]
    prompt = list(range(64))
    home = affinity_index(prompt, 64, 3)
    assert prefill_order(rs, prompt, "prefix_affinity", 64, 100)[0] == home
    rs.acquire(home, 500)  # the home is 500 tokens busier than the lightest: load wins
    assert prefill_order(rs, prompt, "prefix_affinity", 64, 100)[0] != home
    assert prefill_order(rs, prompt, "least_outstanding", 64, 100)[0] != home


def test_the_set_follows_members_leaving_and_joining() -> None:
    """Autoscaling: a replica whose deployment runs none leaves the choice (also as a
    prefix-affinity home), one that runs one again joins; unnamed replicas keep state."""
    rs = replicas(0, 10, 20)
    rs.set_members({"prefill-0": 0, "prefill-2": 1})
    assert rs.members() == [1, 2] and rs.by_load() == [1, 2]
    prompt = next(
        list(range(k, k + 64))
        for k in range(1000)
        if affinity_index(list(range(k, k + 64)), 64, 3) == 0
    )
    assert prefill_order(rs, prompt, "prefix_affinity", 64, 100) == [1, 2]
    rs.set_members({"prefill-0": 1})
    assert rs.by_load() == [0, 1, 2]
    assert prefill_order(rs, prompt, "prefix_affinity", 64, 100)[0] == 0
