"""Async streaming over the engine: one background loop steps it, requests await queues.

Every change to a sequence (admission, abort, release of an export) is a command queued
into the step loop: the step thread runs the queued commands, in arrival order, between
two steps. Nothing from the event loop pulls a sequence out from under ``step()``.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import deque
from collections.abc import AsyncGenerator, Callable
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any, TypeVar

from dsv3serve.engine.engine import Engine, KVExport
from dsv3serve.engine.request import Request, TokenOutput
from dsv3serve.engine.speculative.loop import DraftState
from dsv3serve.kvcache.radix_cache import PrefixMatch

T = TypeVar("T")
logger = logging.getLogger(__name__)
Output = TokenOutput | BaseException


class EngineDeadError(RuntimeError):
    """The engine's step failed (e.g. a rank of its group died or a collective timed out).

    Every request in flight fails with it, and so does every later call: the replica must
    be restarted (its health check reports the error).
    """


class PrefillReleasedError(RuntimeError):
    """A prefill was released or aborted by another caller before its KV was exported."""


@dataclass
class _Command:
    """``fn(engine)`` for the step thread; ``future`` (None: fire and forget) gets the result."""

    fn: Callable[[Engine], Any]
    future: asyncio.Future[Any] | None
    loop: asyncio.AbstractEventLoop | None

    def settle(self, value: Any = None, error: BaseException | None = None) -> None:
        """Hand the outcome to the waiting caller (from any thread)."""
        if self.future is None or self.loop is None:
            if error is not None:
                logger.error("engine command %r failed: %r", self.fn, error)
            return
        self.loop.call_soon_threadsafe(_resolve, self.future, value, error)


def _resolve(future: asyncio.Future[Any], value: Any, error: BaseException | None) -> None:
    if future.done():  # the caller was cancelled; the command ran anyway
        return
    if error is None:
        future.set_result(value)
    else:
        future.set_exception(error)


@dataclass
class _Admission:
    """What the step thread knows about one stream: whether the engine took it, and
    whether the caller keeps its exported KV when the stream closes (a finished prefill)."""

    admitted: bool = False
    keep_export: bool = False


class AsyncEngine:
    """``generate(req)`` yields TokenOutputs; leaving the iterator early aborts the request.

    The step loop runs in a worker thread while requests arrive on the event loop. Changes
    to sequences are commands run by the step thread (:meth:`mutate`, :meth:`post`);
    :meth:`call` runs a read, or a change to pages no sequence owns, under the engine lock.
    """

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._lock = threading.Lock()
        self._queues: dict[str, asyncio.Queue[Output]] = {}
        self._commands: deque[_Command] = deque()
        self._loop_task: asyncio.Task[None] | None = None
        self._step_waiters: list[asyncio.Future[None]] = []
        self.dead: EngineDeadError | None = None
        self.steps_done = 0  # steps finished since start: progress, read without the lock

    def call(self, fn: Callable[[Engine], T]) -> T:
        """Run ``fn(engine)`` under the engine lock, now (stats, exports, reservations)."""
        self.check_alive()
        with self._lock:
            return fn(self.engine)

    async def read(self, fn: Callable[[Engine], T]) -> T:
        """:meth:`call` on a worker thread: the event loop runs on while a step holds the
        engine lock (a long prefill step would otherwise stall every stream here)."""
        self.check_alive()
        return await asyncio.to_thread(self.call, fn)

    async def mutate(self, fn: Callable[[Engine], T]) -> T:
        """Run ``fn(engine)`` on the step thread before the next step; returns its result.

        Raises what ``fn`` raised, or EngineDeadError. A cancelled caller does not stop
        the command: it runs when its turn comes.
        """
        self.check_alive()
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()
        self._commands.append(_Command(fn, future, loop))
        self._ensure_loop()
        return await future

    def post(self, fn: Callable[[Engine], object]) -> None:
        """Queue ``fn(engine)`` for the step thread and return at once (releases, aborts).

        After the engine died the command is dropped: a dead engine frees nothing. Without
        a running event loop no step loop runs either, and ``fn`` runs here under the lock.
        """
        if self.dead is not None:
            logger.debug("engine dead: dropped command %r", fn)
            return
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            with self._lock:
                fn(self.engine)
            return
        self._commands.append(_Command(fn, None, None))
        self._ensure_loop()

    def call_or_post(self, fn: Callable[[Engine], object]) -> None:
        """Run ``fn(engine)`` now if no step holds the lock and no command waits, else
        :meth:`post` it: never blocks the caller (frees of pages no sequence owns)."""
        if self.dead is None and not self._commands and self._lock.acquire(blocking=False):
            try:
                fn(self.engine)
            finally:
                self._lock.release()
            return
        self.post(fn)

    async def settle(self) -> None:
        """Wait until every command queued before this call has run (a barrier: commands
        run in order). Returns at once when the engine is dead."""
        if self.dead is None:
            await self.mutate(_nothing)

    async def next_step(self) -> None:
        """Return once the step loop has finished its next step (or stopped: no work left,
        or the engine died); a cancelled caller leaves nothing behind."""
        if self.dead is not None or self._loop_task is None or self._loop_task.done():
            return
        waiter = asyncio.get_running_loop().create_future()
        self._step_waiters.append(waiter)
        try:
            await waiter
        finally:
            if waiter in self._step_waiters:
                self._step_waiters.remove(waiter)

    @property
    def stepping(self) -> bool:
        """Whether the step loop runs now (it stops when no command and no work is left)."""
        return self._loop_task is not None and not self._loop_task.done()

    def _wake_step_waiters(self) -> None:
        waiters, self._step_waiters = self._step_waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)

    def check_alive(self) -> None:
        """Raise the :class:`EngineDeadError` that stopped the step loop, if any."""
        if self.dead is not None:
            raise self.dead

    async def generate(self, req: Request) -> AsyncGenerator[TokenOutput, None]:
        """Stream outputs of all ``n`` sequences of ``req`` until each has finished."""
        stream = self._stream(req, lambda e: e.add_request(req), req.params.n, _Admission())
        async with aclosing(stream) as outs:  # closing us closes it now, not at collection
            async for out in outs:
                yield out

    async def generate_imported(
        self,
        req: Request,
        first_token: int,
        pages: list[int],
        first_logprob: float = 0.0,
        first_top: dict[int, float] | None = None,
        draft: DraftState | None = None,
        prefix: PrefixMatch | None = None,
        cached_tokens: int = 0,
    ) -> AsyncGenerator[TokenOutput, None]:
        """Decode side of PD: stream ``req`` on from KV already in reserved ``pages`` (after
        the locked ``prefix`` pages, with decode-side prefix reuse).

        ``draft``: the prefill side's ``KVExport.draft``, when both run speculative decoding.
        ``cached_tokens``: the prefill side's prefix-cache hit (see ``Engine.import_kv``).
        """
        token, hidden = (None, None) if draft is None else (draft.token, draft.hidden)

        def admit(engine: Engine) -> None:
            engine.import_kv(
                req,
                first_token,
                pages,
                first_logprob,
                first_top,
                token,
                hidden,
                prefix=prefix,
                cached_tokens=cached_tokens,
            )

        async with aclosing(self._stream(req, admit, 1, _Admission())) as outs:
            async for out in outs:
                yield out

    async def prefill(self, req: Request) -> tuple[TokenOutput, KVExport | None]:
        """Prefill side of PD: run ``req`` (n=1) to its first token and keep its KV.

        Returns the first output and the export, or None when the first token already
        finished the request. Cancellation aborts the request and frees its pages; so does
        leaving before the export is read. Raises PrefillReleasedError when the request
        was aborted by another caller while it prefilled.
        """
        ticket = _Admission()
        stream = self._stream(req, lambda e: e.add_request(req, prefill_only=True), 1, ticket)
        try:
            first = await anext(stream)
            if first.finished:
                return first, None
            export = await self.read(lambda e: _export_of(e, req.request_id))
            if export is None:
                raise PrefillReleasedError(f"request {req.request_id!r} ended while it prefilled")
            ticket.keep_export = True
            return first, export
        finally:
            await stream.aclose()  # aborts the request unless the caller keeps its export

    async def _stream(
        self, req: Request, admit: Callable[[Engine], None], n: int, ticket: _Admission
    ) -> AsyncGenerator[TokenOutput, None]:
        """Admit ``req`` on the step thread, then yield its outputs; leaving early aborts it
        (also on the step thread, after the admission: commands run in order)."""
        rid, queue = req.request_id, asyncio.Queue[Output]()

        def admit_and_listen(engine: Engine) -> None:
            admit(engine)  # raises before anything is registered
            self._queues[rid] = queue
            ticket.admitted = True

        def end(engine: Engine) -> None:
            if self._queues.get(rid) is queue:
                del self._queues[rid]
            if ticket.admitted and not (ticket.keep_export and engine.has_export(rid)):
                engine.abort(rid)

        remaining = n
        try:
            await self.mutate(admit_and_listen)
            while remaining:
                out = await queue.get()
                if isinstance(out, BaseException):
                    raise out
                remaining -= int(out.finished)
                yield out
        finally:
            if remaining:
                self.post(end)
            elif self._queues.get(rid) is queue:
                del self._queues[rid]

    def _ensure_loop(self) -> None:
        if self._loop_task is None or self._loop_task.done():
            self._loop_task = asyncio.get_running_loop().create_task(self._run())

    def _step(self) -> list[TokenOutput]:
        with self._lock:
            self._run_commands()
            return self.engine.step() if self.engine.has_unfinished() else []

    def _run_commands(self) -> None:
        """The queued commands, oldest first (step thread, engine lock held)."""
        while self._commands:
            command = self._commands.popleft()
            try:
                value = command.fn(self.engine)
            except Exception as exc:  # noqa: BLE001 - the command's caller gets it
                command.settle(error=exc)
            else:
                command.settle(value)

    async def _run(self) -> None:
        try:
            while self._commands or self.engine.has_unfinished():
                for out in await asyncio.to_thread(self._step):
                    queue = self._queues.get(out.request_id)
                    if queue is not None:
                        queue.put_nowait(out)
                self.steps_done += 1
                self._wake_step_waiters()
        except Exception as exc:  # noqa: BLE001 - every failure ends the engine the same way
            self._fail_all(exc)
        finally:
            self._wake_step_waiters()

    def _fail_all(self, exc: Exception) -> None:
        """The step failed: fail every waiting request and queued command, and every
        later call."""
        logger.error("engine step failed; failing every request", exc_info=exc)
        self.dead = EngineDeadError(f"engine step failed ({type(exc).__name__}: {exc})")
        for queue in self._queues.values():
            queue.put_nowait(self.dead)
        while self._commands:
            self._commands.popleft().settle(error=self.dead)


def _nothing(_engine: Engine) -> None:
    return None


def _export_of(engine: Engine, request_id: str) -> KVExport | None:
    return engine.export_kv(request_id) if engine.has_export(request_id) else None
