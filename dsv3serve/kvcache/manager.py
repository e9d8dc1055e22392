"""KV page accounting: the allocator plus the radix prefix cache (pure Python).

Every page is in exactly one of three states, so ``free + used + cached == num_pages``:

- free: on the allocator's free list;
- used: allocated to a request (its own pages, reservations, exported pages);
- cached: owned by the radix tree. Cached pages are either locked by requests that
  share them (not evictable) or unreferenced (evictable on demand).

``available_pages = free + evictable`` is what an allocation can obtain right now.

With a host tier (the hierarchical cache, ``host_tier.py``) evicted cached pages keep
their KV in host pages, counted apart from the device pool; a prefix match loads them back.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from dsv3serve.kvcache.allocator import PageAllocator, pages_for_tokens
from dsv3serve.kvcache.host_tier import HostTier, TierStats
from dsv3serve.kvcache.radix_cache import PrefixMatch, RadixCache, RadixNode


class KVCacheManager:
    """Allocates pages to requests, evicting unreferenced cached pages when short."""

    def __init__(
        self,
        num_pages: int,
        page_size: int,
        enable_prefix_cache: bool = True,
        host: HostTier | None = None,
    ) -> None:
        self.page_size = page_size
        self._allocator = PageAllocator(num_pages)
        self._cache = RadixCache(page_size, self._allocator, enable_prefix_cache, host)
        self._used: set[int] = set()

    @property
    def host_tier(self) -> HostTier | None:
        """The host-memory tier under the prefix cache, or None when off."""
        return self._cache.host

    @property
    def tier_stats(self) -> TierStats:
        """The host tier's counters (all zero without one)."""
        return self._cache.host.stats if self._cache.host is not None else TierStats()

    @property
    def num_pages(self) -> int:
        """Total pages in the pool."""
        return self._allocator.num_pages

    @property
    def prefix_cache_enabled(self) -> bool:
        """Whether the radix prefix cache keeps pages."""
        return self._cache.enabled

    @property
    def free_pages(self) -> int:
        """Pages on the free list."""
        return self._allocator.num_free

    @property
    def used_pages(self) -> int:
        """Pages allocated to requests and not owned by the radix tree."""
        return len(self._used)

    @property
    def cached_pages(self) -> int:
        """Pages owned by the radix tree, locked or not."""
        return self._cache.cached_pages

    @property
    def evictable_pages(self) -> int:
        """Cached pages no request references."""
        return self._cache.evictable_pages

    @property
    def available_pages(self) -> int:
        """Pages an allocation can get now: free plus evictable."""
        return self.free_pages + self.evictable_pages

    @property
    def usage(self) -> float:
        """Fraction of the pool that cannot be reclaimed now (0-1)."""
        return 1.0 - self.available_pages / self.num_pages

    @property
    def hit_tokens(self) -> int:
        """Prefix-cache hit tokens counted so far."""
        return self._cache.hit_tokens

    @property
    def miss_tokens(self) -> int:
        """Prefix-cache queried tokens that missed."""
        return self._cache.miss_tokens

    def pages_for_tokens(self, num_tokens: int) -> int:
        """Pages needed to hold ``num_tokens`` tokens."""
        return pages_for_tokens(num_tokens, self.page_size)

    def is_used(self, page: int) -> bool:
        """Whether ``page`` is allocated to a request (not free, not tree-owned)."""
        return page in self._used

    def allocate(self, num_pages: int) -> list[int] | None:
        """Allocate ``num_pages`` pages for a request, evicting cached pages if needed.

        Returns None (and changes nothing but evicts) if fewer are available.
        """
        if num_pages > self.available_pages:
            return None
        shortfall = num_pages - self.free_pages
        if shortfall > 0:
            self._cache.evict(shortfall)
        pages = self._allocator.alloc(num_pages)
        assert pages is not None, "eviction freed fewer pages than evictable_pages promised"
        self._used.update(pages)
        return pages

    def free(self, pages: Iterable[int]) -> None:
        """Return request-held pages to the free list; raises on a page not held."""
        pages = list(pages)
        stray = [page for page in pages if page not in self._used]
        if stray:
            raise ValueError(f"pages {stray} are not held by a request (double free?)")
        self._used.difference_update(pages)
        self._allocator.free(pages)

    def match_prefix(
        self, tokens: Sequence[int], salt: str, limit: int | None = None, record_stats: bool = True
    ) -> PrefixMatch:
        """Lock and return the cached full-page prefix of ``tokens`` (see RadixCache)."""
        return self._cache.match_prefix(tokens, salt, limit, record_stats)

    def peek_prefix(self, tokens: Sequence[int], salt: str, limit: int | None = None) -> int:
        """Tokens of ``tokens`` cached now (both tiers), without locking or stats."""
        return self._cache.peek(tokens, salt, limit)

    def peek_prefix_tiers(
        self, tokens: Sequence[int], salt: str, limit: int | None = None
    ) -> tuple[int, int]:
        """``(device_tokens, host_tokens)`` of ``tokens`` cached now, without side effects."""
        return self._cache.peek_tiers(tokens, salt, limit)

    def prefix_hashes(self, max_entries: int, on_device: bool | None = None) -> list[int]:
        """A bounded summary of the cache for routers: see ``RadixCache.prefix_hashes``."""
        return self._cache.prefix_hashes(max_entries, on_device)

    def record_prefix_query(
        self, num_tokens: int, num_hit_tokens: int, num_host_hit_tokens: int = 0
    ) -> None:
        """Count a prefix query made with ``record_stats=False``; ``num_host_hit_tokens``
        of the hits were loaded back from the host tier."""
        self._cache.record_query(num_tokens, num_hit_tokens)
        if self._cache.host is not None:
            self._cache.host.stats.hit_tokens += num_host_hit_tokens

    def insert_prefix(
        self,
        tokens: Sequence[int],
        pages: list[int],
        salt: str,
        handle: RadixNode | None,
    ) -> tuple[RadixNode | None, list[int]]:
        """Hand full ``pages`` holding KV of ``tokens`` to the prefix cache.

        ``handle`` is the caller's current lock (it may cover a head of ``pages`` already in
        the tree). Returns ``(new_handle, tree_pages)``: the caller now holds a lock on
        ``new_handle`` instead of ``handle`` and must use ``tree_pages`` in place of
        ``pages``; its copies of keys the tree already held were freed here. With the cache
        disabled nothing changes and ``(handle, pages)`` comes back.
        """
        if not self.prefix_cache_enabled:
            return handle, pages
        result = self._cache.insert(tokens, pages, salt)
        duplicates = set(result.duplicate_pages)
        self._used.difference_update(p for p in pages if p not in duplicates)
        self.free(result.duplicate_pages)
        self._cache.lock(result.handle)
        self._cache.unlock(handle)
        return result.handle, result.pages

    def release(self, handle: RadixNode | None, pages: Iterable[int]) -> None:
        """Drop a request's prefix lock ``handle`` and free its own ``pages``."""
        self._cache.unlock(handle)
        self.free(pages)

    def evict_all(self) -> int:
        """Free every unreferenced cached page; return how many were freed."""
        return self._cache.evict(self._cache.evictable_pages)

    def check_invariants(self) -> None:
        """Assert that each page is counted exactly once as free, used or cached."""
        self._allocator.check_invariants()
        tree_pages = self._cache.check_invariants()
        assert not tree_pages & self._used, "a page is both used and cached"
        allocated = self._allocator.allocated_pages()
        assert tree_pages | self._used == allocated, "allocated pages not owned by anyone"
        total = self.free_pages + self.used_pages + self.cached_pages
        assert total == self.num_pages, f"free+used+cached = {total} != {self.num_pages}"
