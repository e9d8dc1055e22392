"""Graceful stop: stop admitting, let streams finish within a bound, cut the rest in-band.

``dsv3serve serve`` (``router/launch_stop.py``) creates one :class:`DrainBoard` Ray actor,
named ``DRAIN_BOARD`` in ``DRAIN_NAMESPACE``. On the first SIGTERM or Ctrl-C it calls
``DrainBoard.start``: every router replica listening to the board (``listen``) stops
admitting (new requests get 503 with ``Retry-After``), and at the board's cut time ends
its remaining backend streams with a ``BackendUnavailable`` (a streamed response turns it
into an in-band error event and ``data: [DONE]``; a non-streamed one into a 503). Each
router reports when nothing is in flight; the launcher waits for all of them, at most the
bound, then stops Serve. Without a board (an app deployed by ``serve deploy``) routers do
not listen and Serve's own replica drain applies.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, Callable
from typing import TYPE_CHECKING, Any

from workers.backend import BackendUnavailable
from workers.protocol import TokenChunk

if TYPE_CHECKING:
    from ray.actor import ActorHandle

logger = logging.getLogger(__name__)

DRAIN_BOARD = "dsv3serve-drain-board"
DRAIN_NAMESPACE = "dsv3serve"
CUT_MESSAGE = "the server is shutting down; this stream was ended before it finished"
IDLE_POLL_S = 0.1
STALE_S = 3.0  # a router replica silent this long while draining counts as gone
_END = object()


class Drain:
    """One router replica's drain state; used from its event loop only."""

    def __init__(self) -> None:
        self.draining = False
        self._cut: asyncio.Future[None] | None = None

    def _cut_future(self) -> asyncio.Future[None]:
        if self._cut is None:
            self._cut = asyncio.get_running_loop().create_future()
        return self._cut

    def start(self, cut_at: float) -> None:
        """Stop admitting now; cut the streams still running at wall time ``cut_at``."""
        self.draining = True
        delay = max(0.0, cut_at - time.time())
        asyncio.get_running_loop().call_later(delay, self.cut)

    def cut(self) -> None:
        """End every watched stream now (``watch`` raises BackendUnavailable)."""
        future = self._cut_future()
        if not future.done():
            future.set_result(None)

    async def watch(
        self, chunks: AsyncGenerator[TokenChunk, None]
    ) -> AsyncGenerator[TokenChunk, None]:
        """``chunks`` until they end or ``cut`` runs; closes ``chunks`` on every path."""
        from router.api.sse import close_quietly

        cut = self._cut_future()
        try:
            while True:
                if cut.done():
                    raise BackendUnavailable(CUT_MESSAGE)
                step = asyncio.ensure_future(anext(chunks, _END))
                try:
                    pending: set[asyncio.Future[Any]] = {step, cut}
                    await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                finally:  # cut, or this task cancelled: stop the step before closing
                    if not step.done():
                        step.cancel()
                        await asyncio.gather(step, return_exceptions=True)
                if step.cancelled():
                    raise BackendUnavailable(CUT_MESSAGE)
                item = step.result()
                if item is _END:
                    return
                assert isinstance(item, TokenChunk)
                yield item
        finally:
            await close_quietly(chunks)


class DrainBoard:
    """The launcher's broadcast to router replicas (run as a Ray actor, async methods)."""

    def __init__(self) -> None:
        self._started = asyncio.Event()
        self._cut_at = 0.0
        self._seen: dict[str, float] = {}  # router replica -> when it last reported
        self._idle: set[str] = set()

    def start(self, cut_after_s: float) -> None:
        """Begin draining; routers cut their remaining streams ``cut_after_s`` from now."""
        if not self._started.is_set():
            self._cut_at = time.time() + cut_after_s
            self._started.set()
            now = time.monotonic()  # routers have STALE_S from now to report
            self._seen = {n: now for n in self._seen}

    def register(self, name: str) -> None:
        """A router replica that will report while draining (``seen``, ``report_idle``)."""
        self._seen[name] = time.monotonic()

    def seen(self, name: str) -> None:
        """A draining router replica with requests still in flight."""
        self._seen[name] = time.monotonic()

    async def wait(self) -> float:
        """Returns once draining began: the wall time at which to cut streams."""
        await self._started.wait()
        return self._cut_at

    def report_idle(self, name: str) -> None:
        """A draining router replica with nothing in flight."""
        self._idle.add(name)

    def all_idle(self) -> bool:
        """Every registered router replica reported idle or stopped reporting (it died)."""
        stale = time.monotonic() - STALE_S
        return all(n in self._idle or t < stale for n, t in self._seen.items())


def find_board() -> ActorHandle | None:
    """The launcher's DrainBoard actor handle, or None when there is none."""
    import ray

    try:
        return ray.get_actor(DRAIN_BOARD, namespace=DRAIN_NAMESPACE)
    except ValueError:
        return None


async def listen(name: str, drain: Drain, in_flight: Callable[[], int]) -> None:
    """Follow the board (if any): start ``drain`` when it says so, report when idle."""
    board = await asyncio.to_thread(find_board)
    if board is None:
        return
    await board.register.remote(name)
    cut_at = await board.wait.remote()
    left = max(0.0, cut_at - time.time())
    logger.warning("router %s: draining; cutting streams still running in %.1f s", name, left)
    drain.start(cut_at)
    while in_flight() > 0:
        await board.seen.remote(name)
        await asyncio.sleep(IDLE_POLL_S)
    await board.report_idle.remote(name)
