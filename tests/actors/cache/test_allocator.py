from __future__ import annotations

import pytest
from actorlm.actors.cache.allocator import PageAllocator, PageAllocatorError
from hypothesis import given, settings
from hypothesis import strategies as st


def test_alloc_is_all_or_nothing() -> None:
    a = PageAllocator(4)
    assert a.alloc(3) == [0, 1, 2]
    assert a.alloc(2) is None
    assert (a.num_free, a.num_used) == (1, 3)
    assert a.alloc(1) == [3]
    assert a.alloc(1) is None
    assert a.alloc(0) == []


def test_free_then_reuse_last() -> None:
    a = PageAllocator(4)
    first = a.alloc(2)
    assert first == [0, 1]
    a.free([0])
    # Page 0 went to the back: untouched pages come first.
    assert a.alloc(3) == [2, 3, 0]


def test_double_free_and_foreign_ids_raise_and_change_nothing() -> None:
    a = PageAllocator(4)
    a.alloc(2)
    with pytest.raises(PageAllocatorError):
        a.free([3])  # never allocated
    with pytest.raises(PageAllocatorError):
        a.free([0, 0])  # twice in one call
    with pytest.raises(PageAllocatorError):
        a.free([0, 7])  # foreign id after a valid one: the valid one stays allocated
    with pytest.raises(PageAllocatorError):
        a.free([-1])
    assert a.num_used == 2 and not a.is_free(0)
    a.free([0, 1])
    with pytest.raises(PageAllocatorError):
        a.free([1])
    assert a.num_free == 4


def test_negative_sizes_rejected() -> None:
    with pytest.raises(ValueError):
        PageAllocator(-1)
    with pytest.raises(ValueError):
        PageAllocator(3).alloc(-1)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 6)), max_size=60))
def test_random_alloc_free_never_double_books(ops: list[tuple[bool, int]]) -> None:
    a = PageAllocator(16)
    held: list[int] = []
    for is_alloc, n in ops:
        if is_alloc:
            got = a.alloc(n)
            if n > a.num_free + (len(got) if got else 0):
                assert got is None
            if got is not None:
                assert len(got) == n and not set(got) & set(held)
                held.extend(got)
        else:
            a.free(held[:n])
            del held[:n]
        free = set(a.free_page_ids())
        assert not free & set(held), "a page is both free and used"
        assert len(free) + len(held) == 16 == a.num_free + a.num_used
        assert a.num_used == len(held)
