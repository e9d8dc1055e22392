"""RadixCache and KVCacheManager: matching, salts, ref counts, LRU eviction, accounting."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dsv3serve.kvcache.allocator import PageAllocator
from dsv3serve.kvcache.manager import KVCacheManager
from dsv3serve.kvcache.prefix_hash import page_prefix_hashes
from dsv3serve.kvcache.radix_cache import RadixCache, RadixNode

PAGE = 4


def _cache_with(tokens: list[int], salt: str = "", num_pages: int = 16) -> RadixCache:
    allocator = PageAllocator(num_pages)
    cache = RadixCache(PAGE, allocator)
    pages = allocator.alloc(len(tokens) // PAGE)
    assert pages is not None
    cache.insert(tokens, pages, salt)
    return cache


def test_match_full_pages_only_and_stats() -> None:
    tokens = list(range(12))
    cache = _cache_with(tokens)
    match = cache.match_prefix([*range(10), 99, 98], "")
    assert match.num_tokens == 8 and len(match.pages) == 2
    assert cache.hit_tokens == 8 and cache.miss_tokens == 4
    limited = cache.match_prefix(tokens, "", limit=11)
    assert limited.num_tokens == 8, "a limit of 11 tokens rounds down to 2 full pages"
    cache.unlock(match.handle)
    cache.unlock(limited.handle)


def test_salts_never_share() -> None:
    tokens = list(range(8))
    cache = _cache_with(tokens, salt="tenant-a")
    assert cache.match_prefix(tokens, "tenant-b").num_tokens == 0
    assert cache.match_prefix(tokens, "").num_tokens == 0
    match = cache.match_prefix(tokens, "tenant-a")
    assert match.num_tokens == 8
    cache.unlock(match.handle)


def test_insert_reports_duplicates() -> None:
    allocator = PageAllocator(16)
    cache = RadixCache(PAGE, allocator)
    tokens = list(range(12))
    first = allocator.alloc(2)
    second = allocator.alloc(3)
    assert first is not None and second is not None
    cache.insert(tokens, first)
    result = cache.insert(tokens, second)
    assert result.duplicate_pages == second[:2]
    assert result.pages == [*first, second[2]]
    assert cache.cached_pages == 3


def test_locked_pages_are_not_evicted_and_lru_order() -> None:
    allocator = PageAllocator(16)
    cache = RadixCache(PAGE, allocator)
    old, new = list(range(100, 108)), list(range(200, 208))
    for tokens in (old, new):
        pages = allocator.alloc(2)
        assert pages is not None
        cache.insert(tokens, pages)
    locked = cache.match_prefix(new, "")
    assert cache.evictable_pages == 2
    assert cache.evict(10) == 2, "only the unlocked branch can go"
    assert cache.peek(old) == 0 and cache.peek(new) == 8
    cache.unlock(locked.handle)
    assert cache.evictable_pages == 2
    cache.check_invariants()


def test_lru_evicts_least_recently_used_leaf_first() -> None:
    allocator = PageAllocator(16)
    cache = RadixCache(PAGE, allocator)
    a, b = [1] * 8, [2] * 8
    for tokens in (a, b):
        pages = allocator.alloc(2)
        assert pages is not None
        cache.insert(tokens, pages)
    cache.unlock(cache.match_prefix(a, "").handle)  # touch a: b is now the LRU branch
    assert cache.evict(1) == 1
    assert cache.peek(a) == 8 and cache.peek(b) == 4, "b's leaf page goes first"


def test_unlock_unlocked_raises() -> None:
    cache = _cache_with(list(range(8)))
    match = cache.match_prefix(list(range(8)), "")
    cache.unlock(match.handle)
    with pytest.raises(ValueError, match="not locked"):
        cache.unlock(match.handle)


def test_disabled_cache_keeps_nothing() -> None:
    allocator = PageAllocator(8)
    cache = RadixCache(PAGE, allocator, enabled=False)
    pages = allocator.alloc(2)
    assert pages is not None
    result = cache.insert(list(range(8)), pages)
    assert result.handle is None and result.duplicate_pages == [] and result.pages == pages
    assert cache.cached_pages == 0
    match = cache.match_prefix(list(range(8)), "")
    assert match.num_tokens == 0 and match.handle is None
    assert cache.miss_tokens == 8


def test_manager_evicts_on_allocation_and_accounts_each_page_once() -> None:
    manager = KVCacheManager(num_pages=6, page_size=PAGE)
    pages = manager.allocate(4)
    assert pages is not None
    handle, tree_pages = manager.insert_prefix(list(range(16)), pages[:3], "", None)
    assert tree_pages == pages[:3]
    assert (manager.used_pages, manager.cached_pages, manager.free_pages) == (1, 3, 2)
    manager.check_invariants()
    manager.release(handle, pages[3:])
    assert manager.available_pages == 6 and manager.evictable_pages == 3
    assert manager.allocate(7) is None
    taken = manager.allocate(5)
    assert taken is not None, "allocation evicts unreferenced cached pages"
    assert (manager.used_pages, manager.cached_pages, manager.free_pages) == (5, 1, 0)
    manager.free(taken[:1])
    with pytest.raises(ValueError, match="not held"):
        manager.free(taken[:1])
    manager.check_invariants()


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2), st.integers(1, 4), st.integers(0, 3)), max_size=40))
def test_manager_random_ops_keep_invariants(ops: list[tuple[int, int, int]]) -> None:
    """Random requests insert prefixes from a few shared stems, then release them."""
    manager = KVCacheManager(num_pages=12, page_size=PAGE)
    held: list[tuple[RadixNode | None, list[int]]] = []
    for stem, num_pages, action in ops:
        tokens = [stem] * PAGE + list(range(num_pages * PAGE))
        match = manager.match_prefix(tokens, str(stem % 2))
        extra = manager.allocate(num_pages)
        if extra is None:
            manager.release(match.handle, [])
        else:
            pages = [*match.pages, *extra][: len(tokens) // PAGE]
            leftover = [*match.pages, *extra][len(pages) :]
            handle, _ = manager.insert_prefix(tokens, pages, str(stem % 2), match.handle)
            held.append((handle, leftover))
        if action == 0 and held:
            manager.release(*held.pop(0))
        manager.check_invariants()
    for handle, leftover in held:
        manager.release(handle, leftover)
    manager.evict_all()
    assert manager.free_pages == 12
    manager.check_invariants()


def test_prefix_hashes_name_every_cached_prefix_most_recent_first() -> None:
    cache = _cache_with(list(range(12)), salt="s")
    other = cache._allocator.alloc(2)
    assert other is not None
    cache.insert([50, 51, 52, 53, 54, 55, 56, 57], other, "s")  # touched last
    hashes = cache.prefix_hashes(10)
    assert sorted(hashes) == sorted(
        page_prefix_hashes(list(range(12)), PAGE, "s")
        + page_prefix_hashes(range(50, 58), PAGE, "s")
    )
    assert hashes[0] == page_prefix_hashes(range(50, 58), PAGE, "s")[-1]
    assert cache.prefix_hashes(1) == hashes[:1]
    assert not set(hashes) & set(page_prefix_hashes(list(range(12)), PAGE, ""))
