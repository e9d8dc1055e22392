"""The scheduler over the hierarchical cache: a host tier under the radix cache.

The fake model (``scheduler_util``) reads every token's context back through the page
table, and ``FakeSlotCopier`` moves its per-slot KV between device pages and host pages,
so a page loaded back into the wrong place, or backed up after it was overwritten, changes
the outputs. Invariants of both tiers are checked after every step.
"""

from __future__ import annotations

import random

import pytest
from scheduler_util import (
    VOCAB,
    FakeEngine,
    FakeKVModel,
    expected,
    make_config,
    mixed_workload,
    outputs,
)
from tier_util import FakeSlotCopier

from dsv3serve.engine.scheduler.scheduler import Scheduler, Sequence, SequenceStatus


def _engine(host_pages: int, **overrides: object) -> tuple[FakeEngine, FakeSlotCopier]:
    config = make_config(num_host_pages=host_pages, **overrides)
    model = FakeKVModel(config.page_size)
    copier = FakeSlotCopier(model)
    engine = FakeEngine(Scheduler(config, copier if host_pages else None))
    engine.model = model
    return engine, copier


def _conversations(seed: int, count: int, length: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(VOCAB) for _ in range(length)] for _ in range(count)]


def _second_pass_prefill(
    host_pages: int, reverse: bool = False
) -> tuple[int, dict[str, list[int]], FakeEngine]:
    """Two passes over 6 prefixes of 32 tokens that overflow a 24-page pool (4 tokens a
    page), the second in the same order or (``reverse``) the most recent first: tokens
    computed in the second pass, every output, the engine."""
    engine, _ = _engine(host_pages, num_pages=24, max_running_requests=1)
    prefixes = _conversations(5, 6, 32)
    first = {0: [Sequence(f"a{i}", p + [1, 2], 4) for i, p in enumerate(prefixes)]}
    engine.run(first)
    before = sum(engine.computed.values())
    order = list(enumerate(prefixes))[:: -1 if reverse else 1]
    second = {0: [Sequence(f"b{i}", p + [3, 4, 5], 4) for i, p in order]}
    engine.run(second)
    assert outputs(first) == expected(first) and outputs(second) == expected(second)
    return sum(engine.computed.values()) - before, outputs(first) | outputs(second), engine


def test_second_pass_loads_prefixes_back_instead_of_recomputing() -> None:
    off_tokens, off_outputs, _ = _second_pass_prefill(host_pages=0)
    on_tokens, on_outputs, engine = _second_pass_prefill(host_pages=128)
    assert on_outputs == off_outputs
    assert on_tokens <= 0.2 * off_tokens, (on_tokens, off_tokens)
    stats = engine.scheduler.kv.tier_stats
    assert stats.loaded_pages >= 6 * 7 and stats.hit_tokens == 4 * stats.loaded_pages
    assert engine.scheduler.kv.hit_tokens >= stats.hit_tokens


def test_a_full_host_tier_drops_its_least_recent_pages() -> None:
    """One request at a time over a 3-page pool: each new prompt pushes the oldest cached
    page to a 3-page host tier. ``sx`` caches a chain of two pages (s, x); ``q``, ``z``,
    ``w``, ``v``, ``u`` one page each. x goes to the host first, then s (a host-only page
    with a host child: not droppable yet), q, and the tier is full. Making room for z drops
    x, the least recent droppable page, which leaves s droppable; making room for w drops
    s (used before q). A first-in first-out tier (by the order pages became droppable)
    drops x then q; a most-recent-first one drops q then z."""
    engine, _ = _engine(3, num_pages=3, max_running_requests=1)
    prompts = {"sx": [10, 11, 12, 13, 20, 21, 22, 23, 1]}
    for name, first in (("q", 30), ("z", 40), ("w", 50), ("v", 60), ("u", 70)):
        prompts[name] = [first, first + 1, first + 2, first + 3, 1]
    arrivals = {step: [Sequence(name, p, 1)] for step, (name, p) in enumerate(prompts.items())}
    engine.run(arrivals)
    assert outputs(arrivals) == expected(arrivals)
    kv = engine.scheduler.kv
    tiers = {name: kv.peek_prefix_tiers(prompt, "") for name, prompt in prompts.items()}
    on_host, on_device = (0, 4), (4, 0)
    dropped = (0, 0)
    assert tiers == dict(sx=dropped, q=on_host, z=on_host, w=on_host, v=on_device, u=on_device)
    assert kv.tier_stats.dropped_pages == 2 and kv.host_tier is not None
    assert kv.host_tier.used_pages == 3


def test_a_full_host_tier_still_saves_prefill() -> None:
    on_tokens, _, engine = _second_pass_prefill(host_pages=12, reverse=True)
    off_tokens, _, _ = _second_pass_prefill(host_pages=0, reverse=True)
    stats = engine.scheduler.kv.tier_stats
    assert stats.dropped_pages > 0 and engine.scheduler.kv.host_tier is not None
    assert engine.scheduler.kv.host_tier.used_pages <= 12
    assert on_tokens < off_tokens


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_mixed_workload_with_preemptions_keeps_outputs(seed: int) -> None:
    engine, copier = _engine(48, num_pages=20, max_running_requests=6, chunked_prefill_size=8)
    arrivals = mixed_workload(seed, count=24)
    engine.run(arrivals)
    assert outputs(arrivals) == expected(arrivals)
    assert engine.scheduler.num_preemptions > 0 and copier.backed_up > 0
    _assert_both_tiers_clean(engine)


@pytest.mark.parametrize("state", ["waiting", "mid-prefill", "decoding"])
def test_abort_in_each_state_leaks_nothing_in_either_tier(state: str) -> None:
    engine, _ = _engine(32, num_pages=12, max_running_requests=2, chunked_prefill_size=4)
    scheduler = engine.scheduler
    shared = _conversations(9, 1, 16)[0]
    engine.run({0: [Sequence(f"warm{i}", shared + [i] * 20, 2) for i in range(3)]})
    blocker = Sequence("blocker", shared + [50] * 8, 30)
    target = Sequence("target", shared + list(range(60, 80)), 10, request_id="req-1")
    scheduler.add(blocker)
    scheduler.add(target)
    reached = {
        "waiting": lambda: target.status is SequenceStatus.WAITING,
        "mid-prefill": lambda: 16 < target.num_computed_tokens < len(target.prompt_ids),
        "decoding": lambda: len(target.output_ids) > 1,
    }[state]
    for _ in range(200):
        if reached():
            break
        engine.step()
    assert reached(), state
    assert scheduler.abort("req-1")
    scheduler.check_invariants()
    engine.run({})
    _assert_both_tiers_clean(engine)


def _assert_both_tiers_clean(engine: FakeEngine) -> None:
    """No request holds a page; every cached page, in either tier, belongs to the tree."""
    kv = engine.scheduler.kv
    assert kv.used_pages == 0 and kv.available_pages == kv.num_pages
    kv.evict_all()
    assert kv.free_pages == kv.num_pages
    engine.scheduler.check_invariants()  # host pages in use == the tree's host-only nodes
    tier = kv.host_tier
    assert tier is not None and tier.used_pages > 0
