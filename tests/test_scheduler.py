"""Scheduler: continuous batching, chunked prefill, prefix cache, preemption, abort, PD hooks.

A deterministic fake model stands in for DeepSeek-V3 (which cannot run in CPU tests): it
writes each scheduled token into a fake KV store at the item's slots and computes the next
token from the context it reads back through the sequence's page table, so a wrong slot,
page table or prefix-cache hit changes the output.
"""

from __future__ import annotations

import random
import zlib
from array import array
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dsv3serve.engine.scheduler import (
    ContextLengthError,
    ScheduledBatch,
    Scheduler,
    SchedulerConfig,
    Sequence,
    SequenceStatus,
)

VOCAB = 1000
EOS = 7


def fake_next_token(context: list[int]) -> int:
    """Fake greedy model: the next token is a hash of the whole context."""
    return zlib.crc32(array("q", context).tobytes()) % VOCAB


def reference_output(prompt: list[int], max_new_tokens: int) -> list[int]:
    """What one sequence generates alone, straight from ``fake_next_token``."""
    output: list[int] = []
    while len(output) < max_new_tokens and (not output or output[-1] != EOS):
        output.append(fake_next_token(prompt + output))
    return output


class FakeKVModel:
    """Fake model that keeps (position, token) per KV slot and reads context back by slot."""

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self.kv: dict[int, tuple[int, int]] = {}

    def run(self, batch: ScheduledBatch) -> dict[str, int]:
        for item in batch.items:
            for position, slot, token in zip(
                item.positions, item.slots, item.token_ids, strict=True
            ):
                self.kv[slot] = (position, token)
        return {
            item.seq_id: fake_next_token(self.context(item.seq, item.start + item.num_tokens))
            for item in batch.sample_items
        }

    def context(self, seq: Sequence, length: int) -> list[int]:
        tokens = []
        for position in range(length):
            page = seq.page_table[position // self.page_size]
            stored = self.kv.get(page * self.page_size + position % self.page_size)
            assert stored is not None and stored[0] == position, f"{seq.seq_id}@{position}"
            tokens.append(stored[1])
        return tokens


@dataclass
class FakeEngine:
    """Drives a Scheduler with FakeKVModel and makes the caller's stop decisions."""

    scheduler: Scheduler
    model: FakeKVModel = field(init=False)
    written: dict[str, dict[int, int]] = field(default_factory=dict)  # seq -> pos -> slot
    final_tables: dict[str, list[int]] = field(default_factory=dict)
    computed: dict[str, int] = field(default_factory=dict)
    max_prefill_step: int = 0
    first_step: dict[str, int] = field(default_factory=dict)
    finished_by_scheduler: list[Sequence] = field(default_factory=list)
    steps: int = 0

    def __post_init__(self) -> None:
        self.model = FakeKVModel(self.scheduler.config.page_size)

    def step(self) -> ScheduledBatch | None:
        batch = self.scheduler.schedule()
        self.steps += 1
        if batch is not None:
            self._check_batch(batch)
            self.scheduler.on_step_done(batch, self.model.run(batch))
            for item in batch.sample_items:
                self._maybe_stop(item.seq)
        self.finished_by_scheduler += self.scheduler.pop_finished()
        self.scheduler.check_invariants()
        return batch

    def run(self, arrivals: dict[int, list[Sequence]], max_steps: int = 5000) -> int:
        step = 0
        while step <= max(arrivals, default=0) or self.scheduler.has_unfinished:
            for seq in arrivals.get(step, []):
                self.scheduler.add(seq)
            self.step()
            step += 1
            assert step < max_steps, "scheduler stopped making progress"
        return step

    def _maybe_stop(self, seq: Sequence) -> None:
        if seq.is_finished:
            return
        if seq.output_ids[-1] == EOS or len(seq.output_ids) >= seq.max_new_tokens:
            self.final_tables[seq.seq_id] = list(seq.page_table)
            self.scheduler.finish(seq, "stop")

    def _check_batch(self, batch: ScheduledBatch) -> None:
        config = self.scheduler.config
        assert batch.num_tokens <= config.max_num_batched_tokens
        assert config.chunking or all(item.sample for item in batch.items), "prompt was split"
        prefill = sum(item.num_tokens for item in batch.prefill_items)
        self.max_prefill_step = max(self.max_prefill_step, prefill)
        all_slots = [slot for item in batch.items for slot in item.slots]
        assert len(set(all_slots)) == len(all_slots), "two tokens share a slot"
        for item in batch.items:
            seq, page_size = item.seq, config.page_size
            owned = set(seq.page_table[seq.num_tree_pages :])
            assert item.token_ids == seq.all_token_ids[item.start : item.start + item.num_tokens]
            assert item.sample == (item.start + item.num_tokens == seq.num_tokens)
            assert all(slot // page_size in owned for slot in item.slots), "write to foreign page"
            assert all(self.scheduler.kv.is_used(slot // page_size) for slot in item.slots)
            self.first_step.setdefault(seq.seq_id, self.steps)
            log = self.written.setdefault(seq.seq_id, {})
            log.update(zip(item.positions, item.slots, strict=True))
            self.computed[seq.seq_id] = self.computed.get(seq.seq_id, 0) + item.num_tokens


def make_config(**overrides: object) -> SchedulerConfig:
    values: dict[str, object] = dict(page_size=4, num_pages=256, max_running_requests=8)
    values.update(chunked_prefill_size=16, max_num_batched_tokens=64, max_context_len=128)
    return SchedulerConfig(**{**values, **overrides})  # type: ignore[arg-type]


def mixed_workload(seed: int, count: int = 32) -> dict[int, list[Sequence]]:
    """``count`` prompts of mixed lengths, some sharing stems, arriving over 20 steps."""
    rng = random.Random(seed)
    stems = [[rng.randrange(VOCAB) for _ in range(n)] for n in (0, 9, 17)]
    arrivals: dict[int, list[Sequence]] = {}
    for index in range(count):
        prompt = rng.choice(stems) + [rng.randrange(VOCAB) for _ in range(rng.randint(1, 40))]
        seq = Sequence(f"s{index}", prompt, max_new_tokens=rng.randint(1, 20))
        arrivals.setdefault(rng.randrange(20), []).append(seq)
    return arrivals


def all_seqs(arrivals: dict[int, list[Sequence]]) -> list[Sequence]:
    return [seq for seqs in arrivals.values() for seq in seqs]


def outputs(arrivals: dict[int, list[Sequence]]) -> dict[str, list[int]]:
    return {seq.seq_id: seq.output_ids for seq in all_seqs(arrivals)}


def expected(arrivals: dict[int, list[Sequence]]) -> dict[str, list[int]]:
    return {s.seq_id: reference_output(s.prompt_ids, s.max_new_tokens) for s in all_seqs(arrivals)}


def assert_all_pages_back(scheduler: Scheduler) -> None:
    kv = scheduler.kv
    assert kv.used_pages == 0 and kv.available_pages == kv.num_pages
    kv.evict_all()
    assert kv.free_pages == kv.num_pages
    scheduler.check_invariants()


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


STATES = {
    "waiting": lambda seq: seq.status is SequenceStatus.WAITING,
    "mid-prefill": lambda seq: 0 < seq.num_computed_tokens < len(seq.prompt_ids),
    "decoding": lambda seq: len(seq.output_ids) > 1,
}


@pytest.mark.parametrize("enable_prefix_cache", [True, False])
@pytest.mark.parametrize("state", ["waiting", "mid-prefill", "decoding"])
def test_abort_in_each_state_returns_every_page(state: str, enable_prefix_cache: bool) -> None:
    config = make_config(
        max_running_requests=1, chunked_prefill_size=4, enable_prefix_cache=enable_prefix_cache
    )
    engine = FakeEngine(Scheduler(config))
    scheduler = engine.scheduler
    blocker = Sequence("blocker", list(range(6)), 3)
    target = Sequence("target", list(range(50, 80)), 10, request_id="req-1")
    if state == "waiting":
        scheduler.add(blocker)
        engine.step()
    scheduler.add(target)
    while not STATES[state](target):
        engine.step()
    assert scheduler.abort("req-1") is True
    assert target.is_finished and target.finish_reason == "abort" and not target.page_table
    assert scheduler.abort("req-1") is False and scheduler.abort("nope") is False
    engine.run({})
    assert_all_pages_back(scheduler)


def test_abort_between_schedule_and_step_done() -> None:
    engine = FakeEngine(Scheduler(make_config()))
    seq = Sequence("s", list(range(20)), 5)
    engine.scheduler.add(seq)
    batch = engine.scheduler.schedule()
    assert batch is not None
    sampled = engine.model.run(batch)
    engine.scheduler.abort("s")
    engine.scheduler.on_step_done(batch, sampled)  # the aborted item is skipped
    assert seq.output_ids == [] and seq.num_computed_tokens == 0
    assert_all_pages_back(engine.scheduler)


def test_context_length_errors_are_clear() -> None:
    scheduler = Scheduler(make_config(num_pages=4, max_context_len=40))
    with pytest.raises(ContextLengthError) as too_long:
        scheduler.add(Sequence("r", list(range(30)), max_new_tokens=20))
    message = str(too_long.value)
    assert "30 tokens" in message and "max_new_tokens 20" in message and "40" in message
    assert isinstance(too_long.value, ValueError)
    with pytest.raises(ContextLengthError, match="needs 5 KV pages but the pool has 4"):
        scheduler.add(Sequence("r", list(range(17)), max_new_tokens=1))
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        make_config(chunked_prefill_size=0, max_num_batched_tokens=64, max_context_len=128)
    assert not scheduler.has_unfinished


def test_whole_prompt_per_step_without_chunking() -> None:
    arrivals = mixed_workload(seed=4, count=10)
    config = make_config(chunked_prefill_size=0, max_num_batched_tokens=128)
    engine = FakeEngine(Scheduler(config))
    engine.run(arrivals)  # _check_batch asserts that no prompt is split across steps
    assert outputs(arrivals) == expected(arrivals)


def test_prefill_decode_disaggregation_hooks() -> None:
    prompt = list(range(400, 422))
    prefill = FakeEngine(Scheduler(make_config()))
    exported = Sequence("p", prompt, 1, request_id="req", prefill_only=True)
    prefill.scheduler.add(exported)
    while not exported.is_finished:
        prefill.step()
    assert exported.finish_reason == "prefilled" and exported.page_table
    assert prefill.scheduler.num_exported == 1 and prefill.scheduler.kv.usage > 0
    decode = FakeEngine(Scheduler(make_config()))
    assert decode.scheduler.reserve(10_000) is None
    pages = decode.scheduler.reserve(len(prompt))
    assert pages is not None and decode.scheduler.kv.used_pages == len(pages)
    for position in range(len(prompt)):  # the "transfer": copy KV rows page by page
        source = exported.page_table[position // 4] * 4 + position % 4
        decode.model.kv[pages[position // 4] * 4 + position % 4] = prefill.model.kv[source]
    prefill.scheduler.release_exported(exported)
    assert_all_pages_back(prefill.scheduler)
    seq = Sequence("d", prompt, 8, output_ids=list(exported.output_ids))
    decode.scheduler.add_prefilled(seq, pages)
    decode.run({})
    assert seq.output_ids == reference_output(prompt, 8)
    spare = decode.scheduler.reserve(5)
    assert spare is not None
    decode.scheduler.release_reservation(spare)
    with pytest.raises(ValueError, match="not reserved"):
        decode.scheduler.release_reservation(spare)
    assert_all_pages_back(decode.scheduler)


def test_abort_of_prefilled_sequence_waiting_for_a_running_slot() -> None:
    engine = FakeEngine(Scheduler(make_config(max_running_requests=1)))
    seqs = []
    for index in range(2):
        pages = engine.scheduler.reserve(9)
        assert pages is not None
        seq = Sequence(f"d{index}", list(range(9)), 5, output_ids=[1])
        engine.scheduler.add_prefilled(seq, pages)
        seqs.append(seq)
    batch = engine.scheduler.schedule()  # admits d0 only; d1 keeps its pages while it waits
    assert batch is not None and [item.seq_id for item in batch.items] == ["d0"]
    assert batch.items[0].is_decode and engine.scheduler.num_waiting == 1
    assert engine.scheduler.abort("d1") and engine.scheduler.abort("d0")
    assert_all_pages_back(engine.scheduler)


def test_abort_releases_exported_pages() -> None:
    engine = FakeEngine(Scheduler(make_config()))
    seq = Sequence("p", list(range(13)), 1, request_id="req", prefill_only=True)
    engine.run({0: [seq]})
    assert engine.scheduler.num_exported == 1
    assert engine.scheduler.abort("req") is True and engine.scheduler.num_exported == 0
    assert_all_pages_back(engine.scheduler)


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
