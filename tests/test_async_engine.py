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
