"""A fake model and engine loop over the real Scheduler, for the scheduler tests."""

from __future__ import annotations

import random
import zlib
from array import array
from dataclasses import dataclass, field

from dsv3serve.engine.scheduler.scheduler import (
    ScheduledBatch,
    Scheduler,
    SchedulerConfig,
    Sequence,
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
