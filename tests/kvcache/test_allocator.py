"""PageAllocator: allocation, exhaustion, double-free detection."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dsv3serve.kvcache.allocator import PageAllocator, pages_for_tokens


def test_alloc_until_exhausted_then_none() -> None:
    allocator = PageAllocator(8)
    first = allocator.alloc(5)
    assert first is not None and len(set(first)) == 5
    assert allocator.num_free == 3
    assert allocator.alloc(4) is None
    assert allocator.num_free == 3, "a failed alloc must not take pages"
    rest = allocator.alloc(3)
    assert rest is not None and set(first) | set(rest) == set(range(8))
    assert allocator.alloc(1) is None
    assert allocator.alloc(0) == []


def test_free_returns_pages() -> None:
    allocator = PageAllocator(4)
    pages = allocator.alloc(4)
    assert pages is not None
    allocator.free(pages[:2])
    assert allocator.num_free == 2
    assert not allocator.is_allocated(pages[0]) and allocator.is_allocated(pages[2])
    allocator.check_invariants()


def test_double_free_raises_and_frees_nothing() -> None:
    allocator = PageAllocator(4)
    pages = allocator.alloc(2)
    assert pages is not None
    allocator.free([pages[0]])
    with pytest.raises(ValueError, match="not allocated"):
        allocator.free([pages[1], pages[0]])
    assert allocator.is_allocated(pages[1]), "an invalid free() call must change nothing"
    with pytest.raises(ValueError, match="twice"):
        allocator.free([pages[1], pages[1]])
    with pytest.raises(ValueError, match="out of range"):
        allocator.free([99])
    allocator.check_invariants()


def test_invalid_sizes() -> None:
    with pytest.raises(ValueError):
        PageAllocator(0)
    with pytest.raises(ValueError):
        PageAllocator(2).alloc(-1)


def test_pages_for_tokens() -> None:
    assert [pages_for_tokens(n, 4) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]
    with pytest.raises(ValueError):
        pages_for_tokens(3, 0)


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 5)), max_size=60))
def test_random_alloc_free_keeps_invariants(ops: list[tuple[bool, int]]) -> None:
    allocator = PageAllocator(16)
    held: list[int] = []
    for is_alloc, count in ops:
        if is_alloc:
            pages = allocator.alloc(count)
            assert (pages is None) == (count > 16 - len(held))
            held.extend(pages or [])
        else:
            allocator.free(held[:count])
            del held[:count]
        allocator.check_invariants()
        assert allocator.num_free + len(held) == 16
