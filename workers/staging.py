"""The prefill side's staged KV, keyed by prefill attempt, and its fenced release.

Every prefill try of a request has its own attempt id (``PrefillRequest.attempt_id``): the
engine runs the try and the connector stages its pages under that id, and ``release``
names it, so the cleanup of one try never reaches another try of the same request.
"""

from __future__ import annotations

import logging

from dsv3serve.engine.async_engine import AsyncEngine
from dsv3serve.engine.engine import Engine, KVExport
from dsv3serve.kvcache.allocator import pages_for_tokens
from kv_transfer.base import KVConnector
from kv_transfer.handle import KVHandle
from workers.leases import LeaseTable
from workers.ranges import PrefillRanges, require_connector

logger = logging.getLogger(__name__)


def release_attempt(engine: Engine, attempt_id: str) -> None:
    """Free what prefill attempt ``attempt_id`` holds in ``engine`` (on the step thread): its
    exported KV, or the attempt itself while it still prefills; else nothing."""
    if engine.release_export(attempt_id) or engine.abort(attempt_id):
        return
    logger.debug(
        "release_kv(%r): no such attempt here (already freed, or another replica's)", attempt_id
    )


class AttemptStaging:
    """Staged KV of prefill attempts under a lease, and the attempts released here.

    A released attempt stays fenced for ``lease_s``: a prefill of it that arrives or ends
    later stages nothing (:meth:`is_released`). ``ranges``: the pages an overlapped
    prefill staged while it ran (``workers/ranges.py``); they go with the attempt.
    """

    def __init__(
        self,
        aengine: AsyncEngine,
        connector: KVConnector | None,
        lease_s: float,
        page_size: int = 1,
    ) -> None:
        self.aengine, self.connector, self.lease_s = aengine, connector, lease_s
        self.page_size = page_size
        self.ranges = PrefillRanges(connector, page_size)
        self._staged: LeaseTable[None] = LeaseTable(lambda attempt, _: self.unstage(attempt))
        self._released: LeaseTable[None] = LeaseTable(lambda attempt, _: None)

    def expire(self) -> None:
        """Free staged KV whose lease ran out; forget old fences."""
        self._staged.expire()
        self._released.expire()

    def is_released(self, attempt_id: str) -> bool:
        """Whether ``release`` named ``attempt_id`` (within the last ``lease_s``)."""
        return attempt_id in self._released

    def check_skip(self, num_tokens: int, skip_pages: int) -> None:
        """Raise ValueError unless skipping ``skip_pages`` leaves a page of a ``num_tokens``
        prompt to stage: a prefill checks this before it runs (:meth:`stage` assumes it)."""
        num_pages = pages_for_tokens(num_tokens, self.page_size)
        if not 0 <= skip_pages < num_pages:
            raise ValueError(
                f"skip_pages must be in [0, {num_pages}) for a prompt of {num_tokens} "
                f"tokens in pages of {self.page_size}, got {skip_pages}"
            )

    def stage(
        self, attempt_id: str, export: KVExport, num_tokens: int, skip_pages: int = 0
    ) -> KVHandle:
        """Publish the prompt pages of ``export`` from page ``skip_pages`` on (the decode
        side holds the ones before; :meth:`check_skip` passed), less those its ranges
        staged already, for a pull, under a lease; on failure the export is freed and the
        error raised."""
        num_pages = pages_for_tokens(num_tokens, export.page_size)
        try:
            first = self.ranges.staged_end(attempt_id, skip_pages)  # < num_pages
            pages = export.pages[first:num_pages]
            staged_tokens = num_tokens - first * export.page_size
            handle = require_connector(self.connector).publish(attempt_id, pages, staged_tokens)
        except BaseException:
            self.unstage(attempt_id)
            raise
        self._staged.add(attempt_id, None, self.lease_s)
        return handle.model_copy(update={"first_page": first})

    async def release(self, attempt_id: str) -> None:
        """Fence ``attempt_id`` and free what it holds; returns once the engine's step
        thread has freed it. Idempotent; an unknown attempt is a no-op."""
        self._released.add(attempt_id, None, self.lease_s)  # before any await: see prefill
        self._staged.take(attempt_id)
        self.ranges.close(attempt_id)
        if self.connector is not None:
            self.connector.release(attempt_id)
        if self.aengine.dead is None:  # a dead engine frees nothing: the replica restarts
            await self.aengine.mutate(lambda e: release_attempt(e, attempt_id))

    def unstage(self, attempt_id: str) -> None:
        """Free ``attempt_id``'s staging and queue the release of its export (a lease that
        ran out, a publish that failed)."""
        self.ranges.close(attempt_id)
        if self.connector is not None:
            self.connector.release(attempt_id)
        self.aengine.post(lambda e: release_attempt(e, attempt_id))
