"""Page-table arithmetic on the host, vectorised (numpy): no Python loop over tokens.

A sequence's position ``p`` lives at slot ``page_table[p // page_size] * page_size +
p % page_size`` (what :class:`~dsv3serve.kvcache.allocator.PageAllocator` pages give).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from dsv3serve.kvcache.allocator import pages_for_tokens as pages_needed  # noqa: F401 (re-export)


def slots_of(page_table: Sequence[int], page_size: int, start: int, end: int) -> np.ndarray:
    """Cache slots [end - start] (int64) of positions ``start .. end-1``."""
    first = start // page_size
    pages = np.asarray(page_table[first : pages_needed(end, page_size)], dtype=np.int64)
    pos = np.arange(start, end, dtype=np.int64)
    return pages[pos // page_size - first] * page_size + pos % page_size


def pages_of_slots(slots: Sequence[int], page_size: int) -> list[int] | None:
    """The page table whose first ``len(slots)`` positions are ``slots``, or None when the
    slots do not fill pages in order (position ``p`` at row ``p % page_size``)."""
    arr = np.asarray(slots, dtype=np.int64)
    if arr.size == 0:
        return []
    pos = np.arange(arr.size, dtype=np.int64)
    pages = arr[::page_size] // page_size
    if (arr[::page_size] % page_size).any():
        return None
    if not np.array_equal(arr, pages[pos // page_size] * page_size + pos % page_size):
        return None
    return pages.tolist()


def flat_positions(starts: np.ndarray, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For sequences with ``counts[b]`` positions from ``starts[b]``: (row of each flattened
    position [sum(counts)], its position), both int64."""
    total = int(counts.sum())
    rows = np.repeat(np.arange(len(counts), dtype=np.int64), counts)
    offsets = np.zeros(len(counts) + 1, dtype=np.int64)
    np.cumsum(counts, out=offsets[1:])
    local = np.arange(total, dtype=np.int64) - offsets[:-1][rows]
    return rows, starts[rows] + local
