"""Waiting for decode KV room without a storm of reserve calls.

A PD request that finds no decode replica with KV room waits up to
``router.reserve_wait_s``. It used to ask every decode replica again every 50 ms: under a
600-stream burst on the 2-core dev VM, 255 such waiters made about 5,000 reserve calls a
second to one decode replica, all on the router's event loop (2026-11-29,
docs/perf/admission_two_routers_cpu.md). Now a waiter sleeps until :class:`RoomSignal`
wakes it, when this router ends a request (the room it held goes back), oldest waiter
first and one per ended request; or until its back-off runs out (room that another
router's requests freed), the back-off doubling from ``RESERVE_RETRY_S`` to
``RESERVE_RETRY_MAX_S``.

How long it waits is :class:`RoomDeadline`'s: a waiter is refused (429) only once the
decode side has made no progress for ``router.reserve_wait_s`` (no decode replica it asked
reports engine steps since its last refusal, and no request ended at
this router), or past ``router.reserve_max_wait_s`` in all. A busy decode side keeps its
waiters (its running streams are bounded by their ``max_tokens``, so room will free); a
stuck one refuses them. Before, the wait was a fixed 5 s from the first ask, so a burst that the
decode side would have served a few seconds later got 429s after 5-18 s.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque

RESERVE_RETRY_S = 0.05
RESERVE_RETRY_MAX_S = 0.8


def next_backoff(delay_s: float) -> float:
    """The wait after one of ``delay_s`` that found no room: doubled, at most the cap."""
    return min(RESERVE_RETRY_MAX_S, 2 * delay_s)


class RoomSignal:
    """Wakes the oldest waiter once per request this router ends. Used from one event loop."""

    def __init__(self) -> None:
        self._waiters: deque[asyncio.Future[None]] = deque()

    @property
    def waiting(self) -> int:
        """Waiters not yet woken (and not timed out or cancelled)."""
        return sum(1 for w in self._waiters if not w.done())

    def freed(self) -> None:
        """A request ended here: wake the oldest waiter still waiting, if any."""
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return

    async def wait(self, timeout_s: float) -> bool:
        """Sleep until :meth:`freed` wakes this waiter (True) or ``timeout_s`` passes."""
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            await asyncio.wait_for(waiter, max(0.0, timeout_s))
            return True
        except asyncio.TimeoutError:
            return False
        finally:
            if not waiter.done():
                waiter.cancel()
            self._drop_done()

    def _drop_done(self) -> None:
        while self._waiters and self._waiters[0].done():
            self._waiters.popleft()


class RoomDeadline:
    """When a reservation waiting for KV room gives up: ``idle_s`` after the last sign of
    room being freed, and never later than ``max_s`` after it started.

    Signs of progress: a decode replica's refusal reports a higher ``ReserveResult.progress``
    (its engine's steps) than the last refusal from it that this
    waiter saw, or this router ended a request (:meth:`progress`). The first refusal from
    a replica only sets its baseline.
    """

    def __init__(self, idle_s: float, max_s: float) -> None:
        now = time.monotonic()
        self._idle_s = idle_s
        self._hard = now + max_s
        self._until = min(now + idle_s, self._hard)
        self._seen: dict[int, int] = {}
        self.progressed = 0  # signs of progress seen (for tests and logs)

    def saw(self, replica: int, progress: int) -> None:
        """A refusal from ``replica`` reporting its ``progress`` count."""
        last = self._seen.get(replica)
        self._seen[replica] = progress
        if last is not None and progress > last:
            self.progress()

    def progress(self) -> None:
        """Room was freed: the idle time-out starts again (up to the hard limit)."""
        self.progressed += 1
        self._until = min(time.monotonic() + self._idle_s, self._hard)

    def left(self) -> float:
        """Seconds until the waiter gives up (0 or less: now)."""
        return self._until - time.monotonic()

    def refusal(self) -> str:
        """The 429's message: why the wait ended."""
        if time.monotonic() >= self._hard:
            return (
                "no decode replica had KV cache room within router.reserve_max_wait_s; retry later"
            )
        return (
            "no decode replica has KV cache room, and none made progress (ran an engine "
            "step) within router.reserve_wait_s; retry later"
        )
