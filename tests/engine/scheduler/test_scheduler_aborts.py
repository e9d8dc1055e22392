"""The scheduler frees every page: aborts in each state, exported pages, PD hooks, errors."""

from __future__ import annotations

import pytest
from scheduler_util import (
    FakeEngine,
    assert_all_pages_back,
    make_config,
    reference_output,
)

from dsv3serve.engine.scheduler.scheduler import (
    ContextLengthError,
    Scheduler,
    Sequence,
    SequenceStatus,
)

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
