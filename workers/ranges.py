"""The prefill side of an overlapped KV transfer: pages of finished chunks staged while the
prefill runs on.

An attempt opened here gets, between engine steps, its prompt pages whose KV is final
(``Engine.prefill_ready_pages``: finished chunks and prefix-cache hits, never the prompt's
last page) published as *ranges*: stagings of their own, ``<attempt id>.r<k>``, which the
router hands to the decode side as they come. The attempt's final staging then covers only
the pages after them (:meth:`PrefillRanges.staged_end`).

A range names pages the running sequence owns, and a lazy connector (torch_dist) reads
them only when pulled. The engine may free or swap those pages (preemption, abort,
prefix-cache dedup); its hook (``Engine.on_pages_dropped``) calls :meth:`drop`, which
releases every range of the attempt (a connector stops reading a staging before its
``release`` returns) and marks the attempt broken: no more ranges, and the final staging
covers every page after ``skip_pages`` again, so the decode side pulls them anew.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import Any

from dsv3serve.engine.async_engine import AsyncEngine
from dsv3serve.engine.engine import Engine
from kv_transfer.base import KVConnector
from kv_transfer.handle import KVHandle

IDLE_POLL_S = 0.01


def require_connector(connector: KVConnector | None) -> KVConnector:
    """``connector``; RuntimeError for None (a colocated replica has none)."""
    if connector is None:
        raise RuntimeError("expected a KV connector, found none: a colocated replica has none")
    return connector


@dataclass
class _Ranges:
    skip_pages: int
    end: int  # the first prompt page no live range covers
    ids: list[str] = field(default_factory=list)
    broken: bool = False


class PrefillRanges:
    """Ranges of the attempts that prefill with an overlapped transfer, by attempt id."""

    def __init__(self, connector: KVConnector | None, page_size: int) -> None:
        self.connector, self.page_size = connector, page_size
        self._lock = threading.Lock()
        self._open: dict[str, _Ranges] = {}

    def __len__(self) -> int:
        with self._lock:
            return len(self._open)

    def open(self, attempt_id: str, skip_pages: int) -> None:
        """Track ``attempt_id``, whose ranges start at prompt page ``skip_pages``."""
        with self._lock:
            self._open[attempt_id] = _Ranges(skip_pages, skip_pages)

    def publish_ready(self, engine: Engine, attempt_id: str) -> KVHandle | None:
        """Step thread, between steps: stage the attempt's pages that became final since its
        last range; their handle (``first_page``: where they start), or None when there
        are none new, or the attempt is broken or not open.

        The copy (shm) runs outside the lock, so a :meth:`close` on the event loop never
        waits for it; a range whose attempt was closed meanwhile is released at once.
        Only the step thread publishes or drops, so nothing else changes ``ids``."""
        with self._lock:
            ranges = self._open.get(attempt_id)
            if ranges is None or ranges.broken:
                return None
            pages = engine.prefill_ready_pages(attempt_id)
            if len(pages) <= ranges.end:
                return None
            first, new = ranges.end, pages[ranges.end :]
            range_id = f"{attempt_id}.r{len(ranges.ids)}"
        handle = require_connector(self.connector).publish(range_id, new, len(new) * self.page_size)
        with self._lock:
            kept = self._open.get(attempt_id) is ranges
            if kept:
                ranges.ids.append(range_id)
                ranges.end = len(pages)
        if not kept:
            require_connector(self.connector).release(range_id)
            return None
        return handle.model_copy(update={"first_page": first})

    def drop(self, attempt_id: str) -> None:
        """The engine is about to free or swap the attempt's pages (step thread): release
        its ranges (no connector reads them once this returns) and stop publishing."""
        with self._lock:
            ranges = self._open.get(attempt_id)
            if ranges is None or not ranges.ids:
                return
            self._release(ranges)
            ranges.broken = True
            ranges.end = ranges.skip_pages

    def staged_end(self, attempt_id: str, skip_pages: int) -> int:
        """The first prompt page the attempt's final staging holds: after its live ranges,
        or ``skip_pages`` (none, broken, or not open)."""
        with self._lock:
            ranges = self._open.get(attempt_id)
            return skip_pages if ranges is None else ranges.end

    def close(self, attempt_id: str) -> None:
        """Release the attempt's ranges and forget it. Idempotent."""
        with self._lock:
            ranges = self._open.pop(attempt_id, None)
        if ranges is not None:
            self._release(ranges)

    def _release(self, ranges: _Ranges) -> None:
        for range_id in ranges.ids:
            require_connector(self.connector).release(range_id)
        ranges.ids = []


async def ranges_while(
    prefill: asyncio.Future[Any], aengine: AsyncEngine, ranges: PrefillRanges, attempt_id: str
) -> AsyncGenerator[KVHandle, None]:
    """Each range of ``attempt_id`` published after an engine step, until ``prefill`` (the
    attempt's prefill) is done. While the engine is idle (the prefill is not admitted
    yet) it looks again every ``IDLE_POLL_S`` instead of spinning."""
    while not prefill.done():
        step = asyncio.ensure_future(aengine.next_step())
        try:
            await asyncio.wait({prefill, step}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            step.cancel()
        if prefill.done():
            return
        if not aengine.stepping:  # no step ran: nothing can have become final
            await asyncio.wait({prefill}, timeout=IDLE_POLL_S)
            continue
        handle = await aengine.mutate(lambda e: ranges.publish_ready(e, attempt_id))
        if handle is not None:
            yield handle
