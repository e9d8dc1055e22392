"""Requests with ``n`` > 1 in PD serving: n sub-requests of one sequence each, merged."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Callable
from contextlib import aclosing

from workers.protocol import GenerateRequest, TokenChunk


def sub_request(req: GenerateRequest, index: int) -> GenerateRequest:
    """Sequence ``index`` of an n>1 request as its own n=1 request (seed + index)."""
    seed = req.params.seed
    params = req.params.model_copy(update={"n": 1, "seed": None if seed is None else seed + index})
    return GenerateRequest(
        request_id=f"{req.request_id}-{index}", prompt_ids=req.prompt_ids, params=params
    )


async def fan_out(
    req: GenerateRequest, one: Callable[[GenerateRequest], AsyncGenerator[TokenChunk, None]]
) -> AsyncGenerator[TokenChunk, None]:
    """Run n sub-requests through ``one`` and merge their chunks (index = sequence).

    An error before any chunk was yielded is raised; later errors arrive in-band.
    """
    queue: asyncio.Queue[tuple[int, TokenChunk | BaseException | None]] = asyncio.Queue()

    async def pump(i: int) -> None:
        try:
            async with aclosing(one(sub_request(req, i))) as chunks:
                async for chunk in chunks:
                    await queue.put((i, chunk))
            await queue.put((i, None))
        except Exception as exc:
            await queue.put((i, exc))

    tasks = [asyncio.create_task(pump(i)) for i in range(req.params.n)]
    done, yielded = 0, False
    try:
        while done < len(tasks):
            i, item = await queue.get()
            if item is None:
                done += 1
                continue
            if isinstance(item, BaseException):
                if not yielded:
                    raise item
                done += 1
                item = TokenChunk(
                    request_id=req.request_id,
                    finished=True,
                    finish_reason="error",
                    error=str(item),
                    error_status=500,
                )
            yielded = True
            yield item.model_copy(update={"index": i, "request_id": req.request_id})
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
