"""Deadlines for resources held on behalf of a peer (staged KV, decode reservations)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Generic, TypeVar

V = TypeVar("V")


class LeaseTable(Generic[V]):
    """Values keyed by request id that expire; ``on_expire`` frees what they hold."""

    def __init__(self, on_expire: Callable[[str, V], None]) -> None:
        self._items: dict[str, tuple[float, V]] = {}
        self._on_expire = on_expire

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, key: str) -> bool:
        return key in self._items

    def add(self, key: str, value: V, ttl_s: float) -> None:
        """Hold ``value`` for ``key`` until ``take`` or ``ttl_s`` seconds pass."""
        self._items[key] = (time.monotonic() + ttl_s, value)

    def get(self, key: str) -> V | None:
        """The value, left in place (None when absent or already expired)."""
        item = self._items.get(key)
        return None if item is None else item[1]

    def take(self, key: str) -> V | None:
        """Remove and return the value (None when absent or already expired)."""
        item = self._items.pop(key, None)
        return None if item is None else item[1]

    def expire(self, now: float | None = None) -> list[str]:
        """Free every value past its deadline; returns their keys."""
        now = time.monotonic() if now is None else now
        dead = [k for k, (deadline, _) in self._items.items() if deadline <= now]
        for key in dead:
            self._on_expire(key, self._items.pop(key)[1])
        return dead
