"""Admission control: at most ``max_in_flight`` requests are admitted at once."""

from __future__ import annotations


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

    def try_acquire(self) -> Slot | None:
        """A slot, or None when ``max_in_flight`` requests are already in flight."""
        if self._in_flight >= self.max_in_flight:
            return None
        self._in_flight += 1
        return Slot(self)
