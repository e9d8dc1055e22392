"""Admission control: at most ``max_in_flight`` requests are admitted at once.

A full router answers 429 before it reads the body (``Admission.full``), and Serve's
proxy is told the router's budget (:func:`router_max_ongoing`), so it routes new
requests to a router with room instead of one that can only refuse them.
"""

from __future__ import annotations

MIN_REFUSAL_HEADROOM = 32


def router_max_ongoing(max_in_flight: int) -> int:
    """The router deployment's ``max_ongoing_requests`` for an admission budget of
    ``max_in_flight``: the budget plus headroom (a quarter of it, at least
    :data:`MIN_REFUSAL_HEADROOM`) for the requests it refuses at once and for health,
    model and metrics calls. Serve's proxy sends no request to a router at this count
    and picks the less loaded of two routers, so a full router's load goes to the other;
    when every router is at it, the proxy holds requests until one has room."""
    return max_in_flight + max(MIN_REFUSAL_HEADROOM, max_in_flight // 4)


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
