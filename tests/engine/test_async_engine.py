"""Async streaming: concurrent generate() calls, incremental text, abort on early exit."""

from __future__ import annotations

import asyncio
import threading
import time

from engine_util import GREEDY, drain, make_engine, prompts, run_alone

from dsv3serve.engine.async_engine import AsyncEngine
from dsv3serve.engine.request import Request


def test_concurrent_streams_match_offline_and_early_exit_aborts() -> None:
    engine = make_engine()
    ps = prompts(4, seed=21)
    expected = [run_alone(engine, p) for p in ps]
    aeng = AsyncEngine(engine)

    async def collect(i: int) -> list[int]:
        got: list[int] = []
        async for out in aeng.generate(Request(f"s{i}", GREEDY, prompt_ids=ps[i])):
            got += out.token_ids
        return got

    async def leave_early() -> int:
        seen = 0
        stream = aeng.generate(Request("early", GREEDY, prompt_ids=ps[0]))
        async for _ in stream:
            seen += 1
            break
        await stream.aclose()
        return seen

    async def main() -> tuple[list[list[int]], int]:
        results = await asyncio.gather(*(collect(i) for i in range(4)), leave_early())
        return list(results[:4]), results[4]

    streams, seen = asyncio.run(main())
    assert streams == expected and seen == 1
    drain(engine)
    engine.scheduler.kv.evict_all()
    assert engine.scheduler.kv.free_pages == engine.scheduler.kv.num_pages
    assert not engine.has_unfinished()


def test_closing_a_stream_queues_its_abort_before_returning() -> None:
    """The abort is queued by ``aclose()`` itself, ahead of any later command; it used to
    wait for the inner stream's collection, so a command queued next could run first."""
    engine = make_engine()
    aeng = AsyncEngine(engine)

    async def live_after_close() -> int:
        stream = aeng.generate(Request("g", GREEDY, prompt_ids=prompts(1, seed=3)[0]))
        await anext(stream)
        await stream.aclose()
        return await aeng.mutate(lambda e: e.num_live_sequences)

    assert asyncio.run(live_after_close()) == 0


def test_read_waits_for_a_held_engine_lock_off_the_event_loop() -> None:
    """A long step holds the engine lock: ``read`` waits for it on a worker thread while
    the event loop runs on (``call`` would block the loop, and every stream, that long)."""
    aeng = AsyncEngine(make_engine())
    held = threading.Event()

    def long_step() -> None:
        with aeng._lock:  # what the step thread holds through a step
            held.set()
            time.sleep(0.3)

    async def main() -> tuple[int, int]:
        ticks = 0

        async def tick() -> None:
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        ticker = asyncio.ensure_future(tick())
        thread = threading.Thread(target=long_step)
        thread.start()
        held.wait()
        live = await aeng.read(lambda e: e.num_live_sequences)
        ticker.cancel()
        thread.join()
        return ticks, live

    ticks, live = asyncio.run(main())
    assert live == 0 and ticks >= 10, f"the loop ticked {ticks} times in 0.3 s"


class FailingRunnerFake:
    """Stands in for a group leader whose collective fails after ``ok_steps`` steps (a
    dead rank): a real rank death is tested through Ray in the worker-group tests."""

    def __init__(self, runner: object, ok_steps: int) -> None:
        self.runner, self.ok_steps = runner, ok_steps

    def __getattr__(self, name: str) -> object:
        return getattr(self.runner, name)

    def run(self, items: list) -> object:
        if self.ok_steps == 0:
            raise RuntimeError("Connection closed by peer (rank 1)")
        self.ok_steps -= 1
        return self.runner.run(items)  # type: ignore[attr-defined]


def test_a_failed_step_fails_every_stream_and_later_calls() -> None:
    import pytest

    from dsv3serve.engine.async_engine import EngineDeadError

    engine = make_engine()
    engine.use_runner(FailingRunnerFake(engine.runner, ok_steps=2))
    aeng = AsyncEngine(engine)
    ps = prompts(2, seed=5)

    async def collect(i: int) -> list[int]:
        got: list[int] = []
        async for out in aeng.generate(Request(f"f{i}", GREEDY, prompt_ids=ps[i])):
            got += out.token_ids
        return got

    async def main() -> list[object]:
        streams = (collect(i) for i in range(2))
        return await asyncio.wait_for(asyncio.gather(*streams, return_exceptions=True), 30)

    results = asyncio.run(main())
    assert all(isinstance(r, EngineDeadError) for r in results), results
    assert "rank 1" in str(results[0])
    with pytest.raises(EngineDeadError):
        aeng.call(lambda e: e.has_unfinished())


def test_commands_run_on_the_step_thread_between_steps_in_order() -> None:
    """Aborts, admissions and releases are queued into the step loop: each runs off the
    event loop thread, never inside a step, in the order they were queued."""
    import threading

    engine = make_engine(chunked_prefill_size=8)
    events: list[str] = []
    real_step = engine.step

    def traced_step():  # noqa: ANN202 - the wrapped method's own signature
        events.append("step-begin")
        try:
            return real_step()
        finally:
            events.append("step-end")

    engine.step = traced_step
    aeng = AsyncEngine(engine)
    ids = prompts(1, seed=9, lo=30, hi=30)[0]

    async def main() -> tuple[list[int], set[int], int]:
        threads: set[int] = set()

        def mark(tag: str):  # noqa: ANN202
            def command(e: object) -> str:
                threads.add(threading.get_ident())
                events.append(tag)
                return tag

            return command

        stream = aeng.generate(Request("a", GREEDY, prompt_ids=ids))
        first = await anext(stream)  # admitted; the prompt took several steps
        aeng.post(mark("posted"))
        got = await aeng.mutate(mark("awaited"))
        assert got == "awaited"
        await stream.aclose()  # queues the abort of "a"
        await aeng.settle()
        return first.token_ids, threads, threading.get_ident()

    first, threads, loop_thread = asyncio.run(main())
    assert first and loop_thread not in threads
    commands = [e for e in events if not e.startswith("step")]
    assert commands == ["posted", "awaited"]
    depth = 0
    for e in events:  # never a command between a step's begin and end
        depth += {"step-begin": 1, "step-end": -1}.get(e, 0)
        assert depth in (0, 1) and (depth == 0 or e.startswith("step"))
    assert not engine.has_unfinished() and engine.num_live_sequences == 0


class GatedFailingRunnerFake:
    """A group leader whose first collective fails (a dead rank), but only once the test
    has queued its commands behind the step: ``entered`` is set inside ``run``, which then
    waits for ``fail``."""

    def __init__(self, runner: object) -> None:
        import threading

        self.runner = runner
        self.entered, self.fail = threading.Event(), threading.Event()

    def __getattr__(self, name: str) -> object:
        return getattr(self.runner, name)

    def run(self, items: list) -> object:
        self.entered.set()
        assert self.fail.wait(60), "the test never released the step"
        raise RuntimeError("Connection closed by peer (rank 1)")


def test_a_dead_engine_fails_queued_commands_instead_of_hanging() -> None:
    import pytest

    from dsv3serve.engine.async_engine import EngineDeadError

    engine = make_engine()
    runner = GatedFailingRunnerFake(engine.runner)
    engine.use_runner(runner)
    aeng = AsyncEngine(engine)
    ids = prompts(1, seed=4)[0]

    async def main() -> list[object]:
        stream = aeng.generate(Request("d", GREEDY, prompt_ids=ids))
        first = asyncio.ensure_future(anext(stream))
        assert await asyncio.to_thread(runner.entered.wait, 60)  # the step is running
        queued = asyncio.ensure_future(aeng.mutate(lambda e: e.num_live_sequences))
        await asyncio.sleep(0)  # one event-loop turn: the command is queued
        runner.fail.set()
        results = await asyncio.gather(first, queued, return_exceptions=True)
        aeng.post(lambda e: e.abort("d"))  # dropped: a dead engine frees nothing
        await aeng.settle()  # returns at once
        with pytest.raises(EngineDeadError):
            await aeng.mutate(lambda e: None)
        return results

    results = asyncio.run(asyncio.wait_for(main(), 60))
    assert all(isinstance(r, EngineDeadError) for r in results), results
    assert "rank 1" in str(results[0])
