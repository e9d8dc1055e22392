"""The decode side of an overlapped KV transfer: ranges pulled into a reservation while its
prefill still runs.

Per request id: which prefill attempt's ranges landed and how many pages of the
reservation they filled (from its start, in order), and the pull in flight. Pulls of one
request run one at a time, and a reservation is freed only once its pull in flight has
ended (:meth:`RangePulls.after_pulls`): the transfer thread never writes into pages that
went back to the pool.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass
class _Progress:
    attempt_id: str = ""
    pulled: int = 0  # pages of the reservation the attempt's ranges filled
    busy: asyncio.Future[Any] | None = None  # the pull writing into the reservation now


class RangePulls:
    """Pull progress and pulls in flight, by request id."""

    def __init__(self) -> None:
        self._progress: dict[str, _Progress] = {}

    def __len__(self) -> int:
        return len(self._progress)

    def pulled(self, request_id: str, attempt_id: str) -> int:
        """Reservation pages filled by ``attempt_id``'s ranges (0 for any other attempt)."""
        progress = self._progress.get(request_id)
        return progress.pulled if progress and progress.attempt_id == attempt_id else 0

    def landed(self, request_id: str, attempt_id: str, pulled: int) -> None:
        """``attempt_id``'s ranges now fill the reservation's first ``pulled`` pages."""
        progress = self._progress.setdefault(request_id, _Progress())
        progress.attempt_id, progress.pulled = attempt_id, pulled

    def begin(self, request_id: str, pull: asyncio.Future[Any]) -> None:
        """``pull`` writes into ``request_id``'s reservation until it is done."""
        self._progress.setdefault(request_id, _Progress()).busy = pull

    async def settle(self, request_id: str) -> None:
        """Wait out the request's pull in flight, if any (its outcome is its caller's)."""
        progress = self._progress.get(request_id)
        if progress is not None and progress.busy is not None:
            with contextlib.suppress(Exception):
                await asyncio.shield(progress.busy)

    def after_pulls(self, request_id: str, free: Callable[[], None]) -> None:
        """Forget ``request_id`` and call ``free`` once its pull in flight has ended (now,
        when none is)."""
        progress = self._progress.pop(request_id, None)
        busy = None if progress is None else progress.busy
        if busy is None or busy.done():
            free()
        else:
            busy.add_done_callback(lambda _: free())
