"""Scheduler: continuous batching, chunked prefill, prefix cache, preemption, abort, PD hooks.

A deterministic fake model stands in for DeepSeek-V3 (which cannot run in CPU tests): it
writes each scheduled token into a fake KV store at the item's slots and computes the next
token from the context it reads back through the sequence's page table, so a wrong slot,
page table or prefix-cache hit changes the output.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from scheduler_util import (
    VOCAB,
    FakeEngine,
    all_seqs,
    assert_all_pages_back,
    expected,
    make_config,
    mixed_workload,
    outputs,
    reference_output,
)

from dsv3serve.engine.scheduler.scheduler import (
    ContextLengthError,
    Scheduler,
    SchedulerConfig,
    Sequence,
    SequenceStatus,
)


@pytest.mark.parametrize("policy", ["fcfs", "lpm"])
def test_batched_run_matches_each_alone(policy: str) -> None:
    arrivals = mixed_workload(seed=1)
    engine = FakeEngine(Scheduler(make_config(policy=policy)))
    engine.run(arrivals)
    assert outputs(arrivals) == expected(arrivals)
    for seq in all_seqs(arrivals)[:4]:  # and literally alone through a fresh scheduler
        alone = Sequence("alone", seq.prompt_ids, seq.max_new_tokens)
        FakeEngine(Scheduler(make_config())).run({0: [alone]})
        assert alone.output_ids == seq.output_ids
    assert engine.scheduler.num_preemptions == 0
    assert_all_pages_back(engine.scheduler)


def test_chunk_sizes_give_same_outputs_and_coverage() -> None:
    results = []
    for chunk in (1, 3, 7, 64):
        arrivals = mixed_workload(seed=2, count=12)
        config = make_config(chunked_prefill_size=chunk, enable_prefix_cache=False)
        engine = FakeEngine(Scheduler(config))
        engine.run(arrivals)
        assert engine.max_prefill_step <= chunk
        for seq in all_seqs(arrivals):
            written = engine.written[seq.seq_id]
            assert sorted(written) == list(range(seq.num_tokens - 1)), "each token computed once"
            assert engine.computed[seq.seq_id] == seq.num_tokens - 1
            table = engine.final_tables[seq.seq_id]
            for position, slot in written.items():
                assert slot == table[position // 4] * 4 + position % 4
        coverage = {seq.seq_id: sorted(engine.written[seq.seq_id]) for seq in all_seqs(arrivals)}
        results.append((outputs(arrivals), coverage))
        assert_all_pages_back(engine.scheduler)
    assert all(result == results[0] for result in results)
    assert results[0][0] == expected(mixed_workload(seed=2, count=12))


def test_prefix_cache_hit_and_salt_isolation() -> None:
    engine = FakeEngine(Scheduler(make_config()))
    prefix = list(range(100, 132))  # 8 full pages
    first = Sequence("first", [*prefix, 1, 2, 3], max_new_tokens=3)
    engine.run({0: [first]})
    second = Sequence("second", [*prefix, 9, 9], max_new_tokens=3)
    other_tenant = Sequence("other", [*prefix, 9, 9], max_new_tokens=3, salt="tenant-b")
    engine.run({0: [second, other_tenant]})
    assert second.num_cached_tokens == 32 and engine.computed["second"] == 34 - 32 + 2
    assert other_tenant.num_cached_tokens == 0 and engine.computed["other"] == 34 + 2
    assert engine.scheduler.prefix_hit_tokens == 32
    assert engine.scheduler.prefix_miss_tokens == 35 + 2 + 34
    for seq in (first, second, other_tenant):
        assert seq.output_ids == reference_output(seq.prompt_ids, 3)
    assert_all_pages_back(engine.scheduler)


def test_prefix_match_never_covers_the_whole_prompt() -> None:
    engine = FakeEngine(Scheduler(make_config()))
    prompt = list(range(8))  # exactly two pages
    engine.run({0: [Sequence("a", prompt, 2)]})
    again = Sequence("b", prompt, 2)
    engine.run({0: [again]})
    assert again.num_cached_tokens == 4, "the last page is recomputed so logits exist"
    assert again.output_ids == reference_output(prompt, 2)


def test_concurrent_requests_share_a_prefix_after_its_prefill() -> None:
    engine = FakeEngine(Scheduler(make_config()))
    prefix = list(range(200, 224))
    engine.run({0: [Sequence("a", [*prefix, 1], 30)], 3: [Sequence("b", [*prefix, 2], 5)]})
    assert engine.scheduler.prefix_hit_tokens == 24


@pytest.mark.parametrize("policy", ["fcfs", "lpm"])
def test_waiting_order_follows_policy(policy: str) -> None:
    engine = FakeEngine(Scheduler(make_config(policy=policy, max_running_requests=1)))
    prefix = list(range(300, 316))
    engine.run({0: [Sequence("warm", [*prefix, 1], 1)]})
    cold = Sequence("cold", [7, 8, 9], 2)
    hot = Sequence("hot", [*prefix, 2], 2)
    engine.run({0: [Sequence("blocker", [5, 6], 4)], 1: [cold, hot]})
    assert hot.num_cached_tokens == 16 and min(engine.written["hot"]) == 16
    hot_first = engine.first_step["hot"] < engine.first_step["cold"]
    assert hot_first == (policy == "lpm")
    assert outputs({0: [cold, hot]}) == expected({0: [cold, hot]})


@pytest.mark.parametrize("enable_prefix_cache", [True, False])
def test_preemption_with_tiny_pool_keeps_outputs(enable_prefix_cache: bool) -> None:
    rng = random.Random(3)
    seqs = [
        Sequence(f"p{i}", [rng.randrange(VOCAB) for _ in range(rng.randint(5, 20))], 20)
        for i in range(10)
    ]
    config = make_config(
        num_pages=16,
        max_running_requests=10,
        chunked_prefill_size=8,
        max_context_len=64,
        enable_prefix_cache=enable_prefix_cache,
    )
    engine = FakeEngine(Scheduler(config))
    engine.run({0: seqs})
    assert engine.scheduler.num_preemptions > 0
    assert all(seq.finish_reason == "stop" for seq in seqs)
    assert outputs({0: seqs}) == expected({0: seqs})
    assert_all_pages_back(engine.scheduler)


def test_preemption_picks_the_most_recent_arrival() -> None:
    config = make_config(num_pages=6, chunked_prefill_size=32, enable_prefix_cache=False)
    engine = FakeEngine(Scheduler(config))
    seqs = [Sequence(name, list(range(i * 10, i * 10 + 8)), 10) for i, name in enumerate("abc")]
    for seq in seqs:
        engine.scheduler.add(seq)
    engine.step()  # three 2-page prompts fill the 6-page pool
    assert engine.scheduler.kv.free_pages == 0
    batch = engine.step()  # a and b each need a third page: c must go
    assert batch is not None and [item.seq_id for item in batch.items] == ["a", "b"]
    assert seqs[2].status is SequenceStatus.WAITING and engine.scheduler.num_preemptions == 1
    engine.run({})
    assert outputs({0: seqs}) == expected({0: seqs})


def test_sequence_outgrowing_the_pool_finishes_with_length() -> None:
    engine = FakeEngine(Scheduler(make_config(num_pages=4, max_context_len=100)))
    seq = Sequence("long", list(range(10)), max_new_tokens=50)
    engine.run({0: [seq]})
    assert engine.finished_by_scheduler == [seq] and seq.finish_reason == "length"
    assert seq.output_ids == reference_output(seq.prompt_ids, 50)[:7], "16 slots: 10 + 6 + 1"
    assert_all_pages_back(engine.scheduler)


def test_identical_prompts_computed_together_end_up_sharing_pages() -> None:
    engine = FakeEngine(Scheduler(make_config(chunked_prefill_size=64)))
    prompt = list(range(500, 530))  # 7 full pages + 2 tokens
    first, second = Sequence("a", prompt, 6), Sequence("b", prompt, 6)
    engine.scheduler.add(first)
    engine.scheduler.add(second)
    engine.step()  # both prefill the same pages in one step
    assert first.page_table[:7] == second.page_table[:7], "b switched to the tree's pages"
    assert engine.scheduler.kv.cached_pages == 7 and engine.scheduler.kv.used_pages == 2
    engine.run({})
    assert first.output_ids == second.output_ids == reference_output(prompt, 6)
    assert_all_pages_back(engine.scheduler)


def test_whole_prompt_per_step_without_chunking() -> None:
    arrivals = mixed_workload(seed=4, count=10)
    config = make_config(chunked_prefill_size=0, max_num_batched_tokens=128)
    engine = FakeEngine(Scheduler(config))
    engine.run(arrivals)  # _check_batch asserts that no prompt is split across steps
    assert outputs(arrivals) == expected(arrivals)


@st.composite
def random_workloads(draw: st.DrawFn) -> tuple[SchedulerConfig, list[tuple[int, Sequence, int]]]:
    page_size = draw(st.sampled_from([1, 2, 4, 8]))
    config = SchedulerConfig(
        page_size=page_size,
        num_pages=draw(st.integers(24, 96)) // page_size,
        max_running_requests=draw(st.integers(1, 12)),
        chunked_prefill_size=draw(st.sampled_from([0, 1, 3, 8, 32])),
        max_num_batched_tokens=draw(st.sampled_from([48, 64, 96])),
        max_context_len=48,
        policy=draw(st.sampled_from(["fcfs", "lpm"])),
        enable_prefix_cache=draw(st.booleans()),
    )
    stems = [list(range(1, 1 + n)) for n in (0, 6, 13)]
    requests = []
    for index in range(draw(st.integers(10, 40))):
        prompt = draw(st.sampled_from(stems)) + draw(
            st.lists(st.integers(0, 50), min_size=1, max_size=30)
        )
        seq = Sequence(
            f"r{index}", prompt, draw(st.integers(1, 12)), salt=draw(st.sampled_from(["", "t"]))
        )
        arrival = draw(st.integers(0, 30))
        abort_at = draw(st.one_of(st.just(-1), st.integers(arrival, arrival + 12)))
        requests.append((arrival, seq, abort_at))
    return config, requests


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(random_workloads())
def test_random_workloads_finish_and_return_pages(
    workload: tuple[SchedulerConfig, list[tuple[int, Sequence, int]]],
) -> None:
    config, requests = workload
    engine = FakeEngine(Scheduler(config))
    scheduler, accepted = engine.scheduler, []
    for step in range(2000):
        for arrival, seq, abort_at in requests:
            if arrival == step:
                try:
                    scheduler.add(seq)
                    accepted.append(seq)
                except ContextLengthError:
                    too_long = len(seq.prompt_ids) + seq.max_new_tokens > config.max_context_len
                    too_big = len(seq.prompt_ids) > config.num_pages * config.page_size
                    assert too_long or too_big
            if abort_at == step:
                scheduler.abort(seq.request_id)
        engine.step()
        if step > 40 and not scheduler.has_unfinished:
            break
    assert not scheduler.has_unfinished, "work left after 2000 steps"
    for seq in accepted:
        assert seq.is_finished and seq.finish_reason in ("stop", "abort", "length")
        reference = reference_output(seq.prompt_ids, seq.max_new_tokens)
        if seq.finish_reason == "stop":
            assert seq.output_ids == reference
        else:
            assert seq.output_ids == reference[: len(seq.output_ids)]
    assert_all_pages_back(scheduler)
