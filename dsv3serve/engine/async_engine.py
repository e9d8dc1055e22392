"""Async streaming over the engine: one background loop steps it, requests await queues."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable
from typing import TypeVar

from dsv3serve.engine.engine import Engine, KVExport
from dsv3serve.engine.request import Request, TokenOutput
from dsv3serve.engine.spec.loop import DraftState

T = TypeVar("T")


class EngineDeadError(RuntimeError):
    """The engine's step failed (e.g. a rank of its group died or a collective timed out).

    Every request in flight fails with it, and so does every later call: the replica must
    be restarted (its health check reports the error).
    """


class AsyncEngine:
    """``generate(req)`` yields TokenOutputs; leaving the iterator early aborts the request.

    Every engine call goes through one lock: the step loop runs in a worker thread while
    requests arrive on the event loop.
    """

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._lock = threading.Lock()
        self._queues: dict[str, asyncio.Queue[TokenOutput | EngineDeadError]] = {}
        self._loop_task: asyncio.Task[None] | None = None
        self.dead: EngineDeadError | None = None

    def call(self, fn: Callable[[Engine], T]) -> T:
        """Run ``fn(engine)`` under the engine lock (reserve, export, release, stats)."""
        self.check_alive()
        with self._lock:
            return fn(self.engine)

    def check_alive(self) -> None:
        """Raise the :class:`EngineDeadError` that stopped the step loop, if any."""
        if self.dead is not None:
            raise self.dead

    async def generate(self, req: Request) -> AsyncIterator[TokenOutput]:
        """Stream outputs of all ``n`` sequences of ``req`` until each has finished."""
        async for out in self._stream(req, lambda e: e.add_request(req), req.params.n):
            yield out

    async def generate_imported(
        self,
        req: Request,
        first_token: int,
        pages: list[int],
        first_logprob: float = 0.0,
        first_top: dict[int, float] | None = None,
        draft: DraftState | None = None,
    ) -> AsyncIterator[TokenOutput]:
        """Decode side of PD: stream ``req`` on from KV already in reserved ``pages``.

        ``draft``: the prefill side's ``KVExport.draft``, when both run speculative decoding.
        """
        token, hidden = (None, None) if draft is None else (draft.token, draft.hidden)

        def admit(engine: Engine) -> None:
            engine.import_kv(req, first_token, pages, first_logprob, first_top, token, hidden)

        async for out in self._stream(req, admit, 1):
            yield out

    async def prefill(self, req: Request) -> tuple[TokenOutput, KVExport | None]:
        """Prefill side of PD: run ``req`` (n=1) to its first token and keep its KV.

        Returns the first output and the export, or None when the first token already
        finished the request. Cancellation aborts the request and frees its pages.
        """
        stream = self._stream(req, lambda e: e.add_request(req, prefill_only=True), 1)
        done = False
        try:
            first = await stream.__anext__()
            export = None if first.finished else self.call(lambda e: e.export_kv(req.request_id))
            done = True
            return first, export
        finally:
            await stream.aclose()  # an exported request survives the close...
            if not done:  # ...unless we were cancelled, perhaps just after its export
                self.call(lambda e: e.abort(req.request_id))

    async def _stream(
        self, req: Request, admit: Callable[[Engine], None], n: int
    ) -> AsyncIterator[TokenOutput]:
        queue: asyncio.Queue[TokenOutput | EngineDeadError] = asyncio.Queue()
        self.call(admit)  # raises before anything is queued
        self._queues[req.request_id] = queue
        self._ensure_loop()
        remaining, completed = n, False
        try:
            while remaining:
                out = await queue.get()
                if isinstance(out, EngineDeadError):
                    raise out
                remaining -= int(out.finished)
                yield out
            completed = True
        finally:
            self._queues.pop(req.request_id, None)
            if not completed and self.dead is None and not self._is_exported(req.request_id):
                self.call(lambda e: e.abort(req.request_id))

    def _is_exported(self, request_id: str) -> bool:
        return self.call(lambda e: e.has_export(request_id))

    def _ensure_loop(self) -> None:
        if self._loop_task is None or self._loop_task.done():
            self._loop_task = asyncio.get_running_loop().create_task(self._run())

    def _step(self) -> list[TokenOutput]:
        with self._lock:
            return self.engine.step()

    async def _run(self) -> None:
        try:
            while self.engine.has_unfinished():
                for out in await asyncio.to_thread(self._step):
                    queue = self._queues.get(out.request_id)
                    if queue is not None:
                        queue.put_nowait(out)
        except Exception as exc:  # noqa: BLE001 - every failure ends the engine the same way
            self._fail_all(exc)

    def _fail_all(self, exc: Exception) -> None:
        """The step failed: fail every waiting request, and every later call."""
        self.dead = EngineDeadError(f"engine step failed ({type(exc).__name__}: {exc})")
        for queue in self._queues.values():
            queue.put_nowait(self.dead)
