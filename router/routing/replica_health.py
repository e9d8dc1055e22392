"""Replicas whose call failed: marked down, probed until they answer again.

A replica that died is restarted by Serve under the same deployment; until it answers a
probe it is tried last (``ReplicaSet.down``), and a caller that has no other replica left
waits for it only within a bound (:meth:`ReplicaHealth.wait_up`).
"""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Awaitable, Callable
from typing import Any

from router.routing.policy import ReplicaSet

Probe = Callable[[Any], Awaitable[bool]]  # a handle -> whether its replica answered


class ReplicaHealth:
    """Down marks of one :class:`ReplicaSet`, each cleared by a background probe."""

    def __init__(self, replicas: ReplicaSet, probe: Probe, interval_s: float) -> None:
        self.replicas = replicas
        self._probe = probe
        self._interval_s = interval_s
        self._up: dict[int, asyncio.Event] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    def mark_down(self, index: int) -> None:
        """Replica ``index`` failed a call: try it last until a probe gets an answer."""
        if index in self._up:
            return
        self.replicas.down.add(index)
        self._up[index] = asyncio.Event()
        # a fresh context: the probe outlives the request that saw the failure.
        loop = asyncio.get_running_loop()
        event = self._up[index]
        task = contextvars.Context().run(loop.create_task, self._watch(index, event))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def mark_up(self, index: int) -> None:
        """Replica ``index`` answered (a probe, or a call that succeeded)."""
        self.replicas.down.discard(index)
        event = self._up.pop(index, None)
        if event is not None:
            event.set()

    async def wait_up(self, index: int, timeout_s: float) -> bool:
        """Whether replica ``index`` is up, waiting at most ``timeout_s`` for it."""
        event = self._up.get(index)
        if event is None:
            return True
        try:
            await asyncio.wait_for(event.wait(), max(timeout_s, 0.0))
        except asyncio.TimeoutError:
            return False
        return True

    async def wait_any_up(self, timeout_s: float) -> bool:
        """Whether some replica is up, waiting at most ``timeout_s`` for one to be."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + max(timeout_s, 0.0)
        while all(i in self._up for i in self.replicas.members()):
            if not self._up:  # no member at all (every one out of the set)
                return False
            waits = [asyncio.ensure_future(event.wait()) for event in self._up.values()]
            try:
                done, _ = await asyncio.wait(
                    waits, timeout=max(deadline - loop.time(), 0.0), return_when="FIRST_COMPLETED"
                )
            finally:
                for wait in waits:
                    wait.cancel()
            if not done:
                return False
        return True

    async def _watch(self, index: int, event: asyncio.Event) -> None:
        handle = self.replicas.handles[index]
        while self._up.get(index) is event:
            if await self._probe(handle):
                self.mark_up(index)
                return
            await asyncio.sleep(self._interval_s)
