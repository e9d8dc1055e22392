"""Admission control: at most ``max_in_flight`` requests are admitted at once.

Serve's proxy enforces the budget before a router sees a request: the router deployment's
``max_ongoing_requests`` is the budget itself (:func:`router_max_ongoing`), so the proxy
sends a request only to a router with room, picking the less loaded of two, holds up to
``router.max_queued_requests`` while every router is full, and refuses the rest at once
with 429 and ``Retry-After`` (an OpenAI body through
:class:`~router.api.proxy_refusals.RefusalBody`). A router answering the refusal itself
had to wait for its event loop, busy with the requests it admitted: 1.65-1.89 s per 429
under a 600-stream burst on 2 cores (docs/perf/admission_two_routers_cpu.md). The
router's own check (``Admission.full``, before the body is read) stays for calls that do
not come through the proxy.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the proxy imports this module: no config (engine) imports at run time
    from router.config import RouterSettings

REFUSAL_RETRY_AFTER_S = 1.0  # the proxy's Retry-After on a 429


def router_max_ongoing(max_in_flight: int) -> int:
    """The router deployment's ``max_ongoing_requests`` for an admission budget of
    ``max_in_flight``: the budget itself (health, model and metrics calls count too, so
    a full router's generation requests never exceed it)."""
    return max_in_flight


def app_budget(router: RouterSettings) -> int:
    """What one app admits at most: its routers' ``max_in_flight`` and its queue."""
    return router.num_replicas * router.max_in_flight + router.max_queued_requests


def admission_limit(routers: Iterable[RouterSettings]) -> int | None:
    """The budget of the proxy's door (:class:`~router.api.proxy_admission.ProxyAdmission`)
    for apps with these router settings: each app's routers' ``max_in_flight`` and its
    ``max_queued_requests``, summed. None when an app sets no queue limit
    (``max_queued_requests`` -1): then the door counts nothing."""
    total = 0
    for router in routers:
        if router.max_queued_requests < 0:
            return None
        total += app_budget(router)
    return total


def serve_queue_limit(router: RouterSettings, door: bool) -> int:
    """Serve's ``max_queued_requests`` for the router deployment: the app's queue when
    Serve's proxy decides alone; with the door counting (``door``) the app's whole budget,
    a loose backstop the door keeps HTTP traffic under (Serve counts a burst's requests as
    queued while it places them, so its own limit at the queue size refuses most of a
    burst: 551 of 600 where 72 were over, docs/perf/admission_two_routers_cpu.md). gRPC,
    which the door does not see, is refused past that backstop."""
    queued = router.max_queued_requests
    if not door or queued < 0:
        return queued
    return app_budget(router)


class Slot:
    """One admitted request; ``release`` is idempotent so every exit path may call it."""

    def __init__(self, owner: Admission) -> None:
        self._owner = owner
        self._released = False

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._owner._in_flight -= 1


class Admission:
    """Counts admitted in-flight requests; refuses new ones once ``max_in_flight`` is reached.

    Used from one event loop only: acquire and release are synchronous, so they never
    interleave with each other and a cancelled request can always release its slot.
    """

    def __init__(self, max_in_flight: int) -> None:
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight must be >= 1, got {max_in_flight}")
        self.max_in_flight = max_in_flight
        self._in_flight = 0

    @property
    def in_flight(self) -> int:
        """Requests admitted and not yet released."""
        return self._in_flight

    @property
    def full(self) -> bool:
        """True when ``try_acquire`` would refuse: checked before a body is read."""
        return self._in_flight >= self.max_in_flight

    def try_acquire(self) -> Slot | None:
        """A slot, or None when ``max_in_flight`` requests are already in flight."""
        if self.full:
            return None
        self._in_flight += 1
        return Slot(self)
