"""The host-memory tier under the radix cache: its pages, LRU and copy log (pure Python).

A radix node whose device page was evicted may keep its KV in a host page instead
(``RadixNode.host_page``); the tree decides which nodes move (``radix_cache.py``), this
class owns the host page ids, the LRU of host-only leaves and the ordered log of copies
that a :class:`PageCopier` carries out. The copies run in the order they were logged
(``flush``), so a page freed by one copy and reused by the next is never read stale.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Protocol

from dsv3serve.kvcache.allocator import PageAllocator

if TYPE_CHECKING:
    from dsv3serve.kvcache.radix_node import RadixNode

CopyKind = Literal["backup", "load"]


class PageCopier(Protocol):
    """Moves whole KV pages between the device pool and the host tier's buffers."""

    def backup(self, device_pages: Sequence[int], host_pages: Sequence[int]) -> None:
        """Copy device page ``device_pages[i]`` into host page ``host_pages[i]``.

        After it returns the device pages may be written by later device work."""

    def load(self, host_pages: Sequence[int], device_pages: Sequence[int]) -> None:
        """Copy host page ``host_pages[i]`` into device page ``device_pages[i]``.

        After it returns later device work sees the loaded KV."""


@dataclass
class TierStats:
    """Cumulative host-tier counters (tokens are prompt tokens at admission)."""

    hit_tokens: int = 0  # prompt tokens served from host pages (loaded back)
    loaded_pages: int = 0
    backed_up_pages: int = 0
    dropped_pages: int = 0  # host pages evicted for room (their KV is gone)
    load_seconds: float = 0.0


class HostTier:
    """Host page ids, the LRU of host-only leaves and the pending copy log."""

    def __init__(self, num_pages: int, copier: PageCopier) -> None:
        self._allocator = PageAllocator(num_pages)
        self._copier = copier
        self._pending: list[tuple[CopyKind, int, int]] = []  # (kind, source, destination)
        self._lru: list[tuple[int, int, RadixNode]] = []
        self._pushes = 0
        self.stats = TierStats()

    @property
    def num_pages(self) -> int:
        """Host pages in the tier."""
        return self._allocator.num_pages

    @property
    def used_pages(self) -> int:
        """Host pages holding an evicted page's KV."""
        return self._allocator.num_allocated

    def allocated_pages(self) -> frozenset[int]:
        """A snapshot of the host pages in use (for invariant checks)."""
        return self._allocator.allocated_pages()

    def alloc(self) -> int | None:
        """One free host page, or None when the tier is full."""
        pages = self._allocator.alloc(1)
        return pages[0] if pages else None

    def free(self, page: int) -> None:
        """Return a host page whose KV is no longer needed."""
        self._allocator.free([page])

    def log_backup(self, device_page: int, host_page: int) -> None:
        """Queue the copy of an evicted device page into ``host_page``."""
        self._pending.append(("backup", device_page, host_page))
        self.stats.backed_up_pages += 1

    def log_load(self, host_page: int, device_page: int) -> None:
        """Queue the copy of ``host_page`` back into ``device_page``."""
        self._pending.append(("load", host_page, device_page))
        self.stats.loaded_pages += 1

    def flush(self) -> None:
        """Carry out the logged copies in order, consecutive ones of a kind together."""
        pending, self._pending = self._pending, []
        start = 0
        while start < len(pending):
            kind = pending[start][0]
            end = start
            while end < len(pending) and pending[end][0] == kind:
                end += 1
            sources = [source for _, source, _ in pending[start:end]]
            destinations = [destination for _, _, destination in pending[start:end]]
            if kind == "backup":
                self._copier.backup(sources, destinations)
            else:
                began = time.perf_counter()
                self._copier.load(sources, destinations)
                self.stats.load_seconds += time.perf_counter() - began
            start = end

    def push_leaf(self, node: RadixNode) -> None:
        """Offer ``node`` to the host LRU if it is a host-only leaf."""
        if not self.is_leaf(node):
            return
        self._pushes += 1
        heapq.heappush(self._lru, (node.last_access, self._pushes, node))
        if len(self._lru) > 4 * self.used_pages + 64:
            self._lru = [entry for entry in self._lru if self._is_candidate(*entry)]
            heapq.heapify(self._lru)

    def pop_lru_leaf(self) -> RadixNode | None:
        """The least recently used host-only leaf still in the tree, or None."""
        while self._lru:
            entry = heapq.heappop(self._lru)
            if self._is_candidate(*entry):
                return entry[2]
        return None

    @staticmethod
    def is_leaf(node: RadixNode) -> bool:
        """Whether ``node`` is in the tree, held only in host memory and childless."""
        attached = node.parent is not None
        return attached and node.page < 0 and node.host_page >= 0 and not node.children

    def _is_candidate(self, last_access: int, _order: int, node: RadixNode) -> bool:
        return self.is_leaf(node) and node.last_access == last_access

    def check_invariants(self, tree_host_pages: set[int]) -> None:
        """Assert that the host pages in use are exactly those the tree holds."""
        self._allocator.check_invariants()
        assert not self._pending, f"{len(self._pending)} host-tier copies not flushed"
        allocated = self._allocator.allocated_pages()
        assert tree_host_pages == allocated, (
            f"host pages leaked or lost: tree holds {sorted(tree_host_pages - allocated)} "
            f"unallocated, allocator holds {sorted(allocated - tree_host_pages)} unowned"
        )
