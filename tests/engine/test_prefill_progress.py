"""Prefill progress for an overlapped KV transfer: which prompt pages are final while a
prefill-only request runs, and the hook that fires before a sequence's pages go back or are
swapped (the scheduler over a fake model; the engine on the tiny model)."""

from __future__ import annotations

from scheduler_util import FakeEngine, make_config
from serving_util import TINY_ENGINE

from dsv3serve.engine.config import EngineConfig
from dsv3serve.engine.engine import Engine
from dsv3serve.engine.request import Request
from dsv3serve.engine.scheduler.scheduler import Scheduler, Sequence
from dsv3serve.sampling.sampling_params import SamplingParams

PAGE = TINY_ENGINE["page_size"]


def test_ready_pages_grow_by_finished_chunks_and_never_hold_the_last_page() -> None:
    engine = Engine(EngineConfig(**{**TINY_ENGINE, "chunked_prefill_size": 2 * PAGE}))
    dropped: list[str] = []
    engine.on_pages_dropped(dropped.append)
    prompt = list(range(500, 500 + 6 * PAGE + 3))  # 7 pages, the last one partial
    params = SamplingParams(temperature=0, max_new_tokens=4)
    engine.add_request(Request("r", params, prompt_ids=prompt), prefill_only=True)
    assert engine.prefill_ready_pages("r") == []  # waiting: nothing computed
    seen = []
    while not engine.has_export("r"):
        engine.step()
        seen.append(len(engine.prefill_ready_pages("r")))
    assert seen == [2, 4, 6, 0]  # chunks of two pages; the last page goes with the result
    assert engine.prefill_ready_pages("r") == [] and dropped == []
    pages = engine.export_kv("r").pages
    assert engine.release_export("r") and dropped == ["r"] and len(pages) == 7


def test_an_abort_mid_prefill_fires_the_hook_before_its_pages_go_back() -> None:
    engine = Engine(EngineConfig(**{**TINY_ENGINE, "chunked_prefill_size": PAGE}))
    free_at_hook: list[int] = []
    engine.on_pages_dropped(lambda rid: free_at_hook.append(engine.scheduler.kv.free_pages))
    params = SamplingParams(temperature=0, max_new_tokens=4)
    engine.add_request(Request("x", params, prompt_ids=list(range(4 * PAGE))), prefill_only=True)
    engine.step()
    ready = engine.prefill_ready_pages("x")
    free_before = engine.scheduler.kv.free_pages
    assert len(ready) == 1
    assert engine.abort("x")
    assert free_at_hook == [free_before]  # called while the pages were still held
    assert engine.scheduler.kv.free_pages + engine.scheduler.kv.evictable_pages > free_before


def test_preemption_fires_the_hook_for_its_victim() -> None:
    config = make_config(num_pages=6, chunked_prefill_size=32, enable_prefix_cache=False)
    scheduler = Scheduler(config)
    dropped: list[str] = []
    scheduler.set_pages_dropped_hook(lambda seq: dropped.append(seq.seq_id))
    fake = FakeEngine(scheduler)
    for i, name in enumerate("abc"):
        scheduler.add(Sequence(name, list(range(i * 10, i * 10 + 8)), 10))
    fake.step()  # three 2-page prompts fill the pool
    fake.step()  # a and b each need a third page: c is preempted
    assert dropped == ["c"] and scheduler.num_preemptions == 1


def test_prefix_cache_dedup_fires_the_hook_for_the_sequence_whose_pages_it_swaps() -> None:
    scheduler = Scheduler(make_config(num_pages=32))
    dropped: list[str] = []
    scheduler.set_pages_dropped_hook(lambda seq: dropped.append(seq.seq_id))
    fake = FakeEngine(scheduler)
    prompt = list(range(100, 109))  # two full pages of 4, then one token
    first, twin = Sequence("a", prompt, 3), Sequence("b", prompt, 3)
    scheduler.add(first)
    scheduler.add(twin)  # admitted in the same step: neither finds the other cached
    fake.step()  # a whole, b's first 7 tokens (the step's budget is 16)
    own = list(twin.page_table)
    fake.step()  # b's prefill ends: its two full pages go to the cache, which has a's
    assert dropped == ["b"] and twin.page_table[:2] == first.page_table[:2] != own[:2]
