"""Async streaming over the engine: one background loop steps it, requests await queues."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator

from dsv3serve.engine.engine import Engine
from dsv3serve.engine.request import Request, TokenOutput


class AsyncEngine:
    """``generate(req)`` yields TokenOutputs; leaving the iterator early aborts the request."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._lock = threading.Lock()  # engine calls come from the loop and a worker thread
        self._queues: dict[str, asyncio.Queue[TokenOutput]] = {}
        self._loop_task: asyncio.Task[None] | None = None

    async def generate(self, req: Request) -> AsyncIterator[TokenOutput]:
        """Stream outputs of all ``n`` sequences of ``req`` until each has finished."""
        queue: asyncio.Queue[TokenOutput] = asyncio.Queue()
        with self._lock:
            self.engine.add_request(req)  # raises before anything is queued
        self._queues[req.request_id] = queue
        self._ensure_loop()
        remaining = req.params.n
        try:
            while remaining:
                out = await queue.get()
                remaining -= int(out.finished)
                yield out
        finally:
            self._queues.pop(req.request_id, None)
            if remaining:
                with self._lock:
                    self.engine.abort(req.request_id)

    def _ensure_loop(self) -> None:
        if self._loop_task is None or self._loop_task.done():
            self._loop_task = asyncio.get_running_loop().create_task(self._run())

    def _step(self) -> list[TokenOutput]:
        with self._lock:
            return self.engine.step()

    async def _run(self) -> None:
        while self.engine.has_unfinished():
            for out in await asyncio.to_thread(self._step):
                queue = self._queues.get(out.request_id)
                if queue is not None:
                    queue.put_nowait(out)
