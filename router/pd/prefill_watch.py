"""A prefill's time-out from its replica's progress, not from a fixed clock.

A long prompt (or a queue of them) keeps a replica busy for minutes on a CPU; that is not a
failure. While a prefill runs the router asks its replica for progress every
``stall_s`` (``WorkerProgress``, answered without the engine lock). The attempt is given
up only when the replica is unresponsive: the progress call does not answer within
``stall_s``, or no engine step finished and none runs over a whole ``stall_s`` window
(the engine is idle while the attempt waits). ``ceiling_s`` bounds the whole attempt.
:func:`prefill_failure` words a failed try for the 503.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from workers.protocol import WorkerProgress

T = TypeVar("T")
Progress = Callable[[], Awaitable[WorkerProgress]]


class PrefillStalled(TimeoutError):
    """The prefill's replica made no progress, or the attempt passed its ceiling."""


async def until_stalled(
    work: Awaitable[T], progress: Progress, stall_s: float, ceiling_s: float
) -> T:
    """``work``'s result; raises PrefillStalled (``work`` cancelled) as the module says."""
    task = asyncio.ensure_future(work)
    deadline = time.monotonic() + ceiling_s
    last: int | None = None
    try:
        while True:
            left = deadline - time.monotonic()
            done, _ = await asyncio.wait({task}, timeout=max(min(stall_s, left), 0.0))
            if done:
                return task.result()
            if time.monotonic() >= deadline:
                raise PrefillStalled(f"not done within router.prefill_timeout_s ({ceiling_s:g} s)")
            last = await _advanced(progress, stall_s, last)
    finally:
        if not task.done():
            task.cancel()


async def _advanced(progress: Progress, stall_s: float, last: int | None) -> int:
    """The replica's step count, if it moved since ``last`` or a step runs now."""
    try:
        now = await asyncio.wait_for(progress(), stall_s)
    except asyncio.TimeoutError:
        raise PrefillStalled(
            f"replica did not answer a progress check within "
            f"router.prefill_stall_timeout_s ({stall_s:g} s)"
        ) from None
    if now.steps == last and not now.stepping:
        raise PrefillStalled(
            f"replica's engine finished no step in router.prefill_stall_timeout_s ({stall_s:g} s)"
        )
    return now.steps


def prefill_failure(exc: Exception, timeout_s: float) -> str:
    """Why a prefill attempt failed, for the 503's message (a time-out says what it
    waited for and how long; asyncio's TimeoutError carries no message; a stall says
    which check the replica failed, not the ceiling it did not reach)."""
    if isinstance(exc, PrefillStalled):
        return f"prefill given up: {exc}"
    if isinstance(exc, TimeoutError):
        detail = f": {exc}" if str(exc) else ""
        return f"no prefill result within prefill_timeout_s ({timeout_s:g} s){detail}"
    return type(exc).__name__  # the replica died or its call failed
