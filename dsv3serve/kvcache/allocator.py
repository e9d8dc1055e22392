"""Free-list allocator for KV-cache pages (pure Python)."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable


def pages_for_tokens(num_tokens: int, page_size: int) -> int:
    """Number of pages of ``page_size`` tokens needed to hold ``num_tokens`` tokens."""
    if page_size <= 0:
        raise ValueError(f"page_size must be positive, got {page_size}")
    if num_tokens < 0:
        raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
    return -(-num_tokens // page_size)


class PageAllocator:
    """Hands out page ids ``0 .. num_pages-1`` and takes them back.

    Pages are reused in FIFO order, so a page freed by mistake is not handed out again at
    once. Freeing a page that is not allocated (double free, unknown id) raises
    ``ValueError`` before any page of the call is freed, so bugs surface early.
    """

    def __init__(self, num_pages: int) -> None:
        if num_pages <= 0:
            raise ValueError(f"num_pages must be positive, got {num_pages}")
        self._num_pages = num_pages
        self._free: deque[int] = deque(range(num_pages))
        self._allocated: set[int] = set()

    @property
    def num_pages(self) -> int:
        """Total number of pages managed."""
        return self._num_pages

    @property
    def num_free(self) -> int:
        """Pages on the free list."""
        return len(self._free)

    @property
    def num_allocated(self) -> int:
        """Pages currently handed out."""
        return len(self._allocated)

    def is_allocated(self, page: int) -> bool:
        """Whether ``page`` is currently handed out."""
        return page in self._allocated

    def allocated_pages(self) -> frozenset[int]:
        """A snapshot of the allocated page ids (for invariant checks)."""
        return frozenset(self._allocated)

    def alloc(self, num_pages: int) -> list[int] | None:
        """Take ``num_pages`` pages off the free list, or return None if too few are free."""
        if num_pages < 0:
            raise ValueError(f"cannot allocate a negative number of pages ({num_pages})")
        if num_pages > len(self._free):
            return None
        pages = [self._free.popleft() for _ in range(num_pages)]
        self._allocated.update(pages)
        return pages

    def free(self, pages: Iterable[int]) -> None:
        """Return ``pages`` to the free list; raises ValueError on a page not allocated."""
        pages = list(pages)
        self._check_freeable(pages)
        self._allocated.difference_update(pages)
        self._free.extend(pages)

    def _check_freeable(self, pages: list[int]) -> None:
        seen: set[int] = set()
        for page in pages:
            if page in seen:
                raise ValueError(f"page {page} appears twice in one free() call")
            if page not in self._allocated:
                state = "out of range" if not 0 <= page < self._num_pages else "not allocated"
                raise ValueError(f"cannot free page {page}: {state} (double free or leak bug)")
            seen.add(page)

    def check_invariants(self) -> None:
        """Raise AssertionError if the free list and the allocated set are inconsistent."""
        free = set(self._free)
        assert len(free) == len(self._free), "a page is on the free list twice"
        assert not free & self._allocated, "a page is both free and allocated"
        assert len(free) + len(self._allocated) == self._num_pages, "pages went missing"
