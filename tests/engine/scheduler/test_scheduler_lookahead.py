"""Scheduler lookahead slots for speculative decoding, driven by a fake speculative model.

The fake target is ``test_scheduler``'s hash model over a fake KV store; its fake draft
guesses the target's continuation but gets some tokens wrong, so rounds accept anything
from none to all of their drafts. Every draft token is written at its lookahead slot and
the target reads its whole context back through the page table, so a wrong slot, a
lookahead slot on a shared page or a rejected token left in the committed KV changes the
output.
"""

from __future__ import annotations

import random

import pytest
from scheduler_util import (
    EOS,
    VOCAB,
    FakeKVModel,
    assert_all_pages_back,
    expected,
    fake_next_token,
    make_config,
    mixed_workload,
    outputs,
)

from dsv3serve.engine.scheduler.scheduler import ScheduledBatch, Scheduler, SchedulerConfig
from dsv3serve.engine.scheduler.sequence import ScheduledItem, Sequence


class FakeSpecModel(FakeKVModel):
    """Drafts the target's continuation, each token wrong with probability ``wrong``."""

    def __init__(self, page_size: int, wrong: float, seed: int) -> None:
        super().__init__(page_size)
        self.wrong, self.rng = wrong, random.Random(seed)
        self.rounds: list[tuple[int, int]] = []  # (drafts, accepted)

    def drafts(self, item: ScheduledItem) -> list[int]:
        context, out = item.seq.all_token_ids, []
        for _ in range(item.num_lookahead):
            token = fake_next_token(context + out)
            out.append((token + 1) % VOCAB if self.rng.random() < self.wrong else token)
        return out

    def run_spec(self, batch: ScheduledBatch) -> dict[str, list[int]]:
        committed = {}
        for item in batch.items:
            drafts = self.drafts(item) if item.is_decode else []
            tokens = item.token_ids + drafts
            assert len(item.slots) == item.num_tokens + item.num_lookahead
            for j, (slot, token) in enumerate(zip(item.slots, tokens, strict=False)):
                self.kv[slot] = (item.start + j, token)
            if item.sample:
                committed[item.seq_id] = self.verify(item, drafts)
        return committed

    def verify(self, item: ScheduledItem, drafts: list[int]) -> list[int]:
        out: list[int] = []
        for j in range(len(drafts) + 1):
            out.append(fake_next_token(self.context(item.seq, item.start + item.num_tokens + j)))
            if out[-1] == EOS or j == len(drafts) or out[-1] != drafts[j]:
                break
        if drafts:
            self.rounds.append((len(drafts), len(out) - 1))
        return out


def run(
    config: SchedulerConfig, arrivals: dict[int, list[Sequence]], wrong: float
) -> tuple[Scheduler, list[tuple[int, int]]]:
    """Drive the scheduler to the end; returns it and every round's (drafts, accepted)."""
    scheduler = Scheduler(config)
    model = FakeSpecModel(config.page_size, wrong, seed=3)
    step = 0
    while step <= max(arrivals) or scheduler.has_unfinished:
        for seq in arrivals.get(step, []):
            scheduler.add(seq)
        batch = scheduler.schedule()
        if batch is not None:
            check_lookahead(scheduler, batch)
            scheduler.on_step_done(batch, model.run_spec(batch))
            for item in batch.sample_items:
                seq = item.seq
                done = len(seq.output_ids) >= seq.max_new_tokens
                if not seq.is_finished and (seq.output_ids[-1] == EOS or done):
                    scheduler.finish(seq, "stop")
        scheduler.pop_finished()
        scheduler.check_invariants()
        step += 1
        assert step < 5000
    return scheduler, model.rounds


def check_lookahead(scheduler: Scheduler, batch: ScheduledBatch) -> None:
    page_size = scheduler.config.page_size
    assert batch.num_tokens + sum(i.num_lookahead for i in batch.items) <= (
        scheduler.config.max_num_batched_tokens
    )
    for item in batch.items:
        seq = item.seq
        assert item.num_lookahead <= scheduler.config.num_lookahead_tokens
        assert item.is_decode or item.num_lookahead == 0
        assert len(seq.output_ids) + 1 + item.num_lookahead <= max(seq.max_new_tokens, 1)
        owned = set(seq.page_table[seq.num_tree_pages :])
        assert all(slot // page_size in owned for slot in item.slots), "lookahead on a shared page"


@pytest.mark.parametrize("wrong", [0.0, 0.3, 1.0])
@pytest.mark.parametrize("enable_prefix_cache", [True, False])
def test_lookahead_rounds_give_the_plain_outputs(wrong: float, enable_prefix_cache: bool) -> None:
    arrivals = mixed_workload(seed=4)
    config = make_config(num_lookahead_tokens=3, enable_prefix_cache=enable_prefix_cache)
    scheduler, rounds = run(config, arrivals, wrong)
    assert outputs(arrivals) == expected(arrivals)
    accepted = sum(a for _, a in rounds)
    assert rounds and (accepted == sum(d for d, _ in rounds)) == (wrong == 0.0)
    assert (accepted == 0) == (wrong == 1.0)
    assert_all_pages_back(scheduler)


@pytest.mark.parametrize("enable_prefix_cache", [True, False])
def test_lookahead_under_a_tiny_pool_preempts_and_keeps_outputs(
    enable_prefix_cache: bool,
) -> None:
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
        num_lookahead_tokens=4,
    )
    scheduler, rounds = run(config, {0: seqs}, wrong=0.3)
    assert scheduler.num_preemptions > 0 and rounds
    assert all(seq.finish_reason == "stop" for seq in seqs)
    assert outputs({0: seqs}) == expected({0: seqs})
    assert_all_pages_back(scheduler)


def test_lookahead_shrinks_to_what_fits_and_never_preempts_for_it() -> None:
    config = make_config(num_pages=3, num_lookahead_tokens=8, max_context_len=64)
    scheduler = Scheduler(config)
    seq = Sequence("s", list(range(1, 8)), max_new_tokens=20)  # 7 prompt tokens: 2 pages
    scheduler.add(seq)
    scheduler.on_step_done(scheduler.schedule(), {"s": 9})
    batch = scheduler.schedule()
    (item,) = batch.items
    assert item.is_decode and item.num_lookahead == 12 - 8  # 3 pages hold 12 tokens
    assert scheduler.num_preemptions == 0
    with pytest.raises(ValueError, match="1 to 5 sampled tokens"):
        scheduler.on_step_done(batch, {"s": [1] * 6})
    scheduler.on_step_done(batch, {"s": [11, 12]})
    assert seq.output_ids == [9, 11, 12] and seq.num_computed_tokens == 9  # 12 has no KV
    scheduler.check_invariants()
