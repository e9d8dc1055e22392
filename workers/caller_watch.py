"""A decode stream stops when the router replica that asked for it is gone.

Ray keeps running an actor's streaming generator after the caller (its owner) died: a
decode stream whose router replica was killed would go on to ``max_tokens`` with no one
to read it, holding its pages and a batch slot. The router names itself in the request
(:class:`~workers.protocol.Caller`, from :func:`current_caller`); the decode replica asks
Ray whether that named actor still exists, at most once per ``interval_s`` per caller
(one lookup for all the streams of one router), off the event loop, and ends the stream
once it does not (closing the stream aborts the request in the engine).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from workers.protocol import Caller

logger = logging.getLogger(__name__)

CHECK_INTERVAL_S = 1.0


def current_caller() -> Caller | None:
    """This process's named Ray actor (a Serve replica), or None outside one."""
    import ray

    if not ray.is_initialized():
        return None
    name = ray.get_runtime_context().get_actor_name()
    if not name:
        return None
    # The runtime context's namespace is the job's; a Serve replica's name lives in Serve's.
    for entry in ray.util.list_named_actors(all_namespaces=True):
        if entry["name"] == name:
            return Caller(name=name, namespace=entry["namespace"])
    return None


def actor_exists(caller: Caller) -> bool:
    """Whether the named actor ``caller`` is alive; an unclear answer (e.g. a GCS error)
    counts as alive: only a failed name lookup means it is gone."""
    import ray

    try:
        ray.get_actor(caller.name, namespace=caller.namespace)
    except ValueError:
        return False
    except Exception:  # not a verdict: keep the stream
        logger.warning("could not look up caller %s", caller.name, exc_info=True)
    return True


class CallerWatch:
    """Cached liveness of callers, refreshed in the background; used from one event loop."""

    def __init__(
        self,
        interval_s: float = CHECK_INTERVAL_S,
        exists: Callable[[Caller], bool] = actor_exists,
    ) -> None:
        self.interval_s = interval_s
        self._exists = exists
        self._next_check: dict[Caller, float] = {}
        self._gone: set[Caller] = set()
        self._checks: set[asyncio.Task[None]] = set()

    def gone(self, caller: Caller) -> bool:
        """Whether ``caller`` was found gone; starts a lookup when the last one is older
        than ``interval_s`` (never waits for it)."""
        if caller in self._gone:
            return True
        now = time.monotonic()
        if now >= self._next_check.get(caller, 0.0):
            self._next_check[caller] = float("inf")  # one lookup at a time per caller
            task = asyncio.get_running_loop().create_task(self._check(caller))
            self._checks.add(task)
            task.add_done_callback(self._checks.discard)
        return False

    async def _check(self, caller: Caller) -> None:
        try:
            alive = await asyncio.to_thread(self._exists, caller)
        except Exception:
            alive = True
        if alive:
            self._next_check[caller] = time.monotonic() + self.interval_s
            return
        logger.warning("router replica %s is gone: ending its decode streams", caller.name)
        self._gone.add(caller)
        self._next_check.pop(caller, None)
