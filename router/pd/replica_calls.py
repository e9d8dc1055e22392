"""Small awaitables over worker replica handles that the PD backend uses.

Background fire-and-forget calls (releases, cancellations), a decode stream's 503 as
:class:`~router.pd.migration.DecodeLost`, a replica's progress, and health probes. No torch
and no Ray are imported here (handles are Serve's, passed in).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
from collections.abc import AsyncGenerator, Awaitable, Callable
from contextlib import aclosing
from typing import Any

from router.pd.migration import DecodeLost
from router.routing.policy import ReplicaSet
from workers.backend import BackendError
from workers.protocol import TokenChunk, WorkerLoad, WorkerProgress
from workers.protocol import decode as parse

HEALTH_TIMEOUT_S = 2.0


class Background:
    """Fire-and-forget remote calls that must still run (releases, cancellations).

    Each call is made in a fresh context: inside a request that Serve is cancelling
    (client disconnect), calls made in the request's context are cancelled with it.
    """

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[Any]] = set()

    def submit(self, method: Callable[..., Awaitable[Any]], *args: Any) -> None:
        """Call ``method(*args)`` (a handle's ``.remote``) in the background."""

        async def quiet() -> None:
            with contextlib.suppress(Exception):  # a lost release: the lease frees it
                await method(*args)

        loop = asyncio.get_running_loop()
        task = contextvars.Context().run(loop.create_task, quiet())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


async def lost_on_503(chunks: AsyncGenerator[TokenChunk, None]) -> AsyncGenerator[TokenChunk, None]:
    """``chunks`` of a decode stream, its 503 (before a chunk: raised; after: in-band)
    raised as DecodeLost; other errors pass as they are."""
    try:
        async with aclosing(chunks) as it:
            async for chunk in it:
                if chunk.error is not None and chunk.error_status == 503:
                    raise DecodeLost(chunk.error)
                yield chunk
    except BackendError as exc:
        if exc.status != 503:
            raise
        raise DecodeLost(exc.message) from None


async def progress_of(handle: Any) -> WorkerProgress:
    """The replica's queue and chunk progress (what the prefill watch reads)."""
    return parse(WorkerProgress, await handle.progress.remote())


async def await_response(response: Any) -> Any:
    """Await a handle call's response (a coroutine for ``asyncio.wait_for``)."""
    return await response


async def answers(handle: Any) -> bool:
    """Whether the replica behind ``handle`` answers ``load`` within HEALTH_TIMEOUT_S."""
    try:
        raw = await asyncio.wait_for(await_response(handle.load.remote()), HEALTH_TIMEOUT_S)
        parse(WorkerLoad, raw)
        return True
    except Exception:
        return False


async def any_alive(replicas: ReplicaSet) -> bool:
    """Whether any member replica of the set answers ``load`` in time."""
    members = [replicas.handles[i] for i in replicas.members()]
    return any(await asyncio.gather(*(answers(h) for h in members)))
