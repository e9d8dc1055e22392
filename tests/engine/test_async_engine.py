"""Async streaming: concurrent generate() calls, incremental text, abort on early exit."""

from __future__ import annotations

import asyncio

from test_engine import GREEDY, drain, make_engine, prompts, run_alone

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
