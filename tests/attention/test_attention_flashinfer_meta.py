"""Host-side index building of the flashinfer backend (pure torch, CPU)."""

from __future__ import annotations

import pytest
import torch

from dsv3serve.attention.flashinfer_meta import (
    PlanStage,
    paged_kv_index,
    prefix_chunks,
    token_kv_index,
)


def _slots(pages: list[int], page_size: int, length: int) -> list[int]:
    return [pages[p // page_size] * page_size + p % page_size for p in range(length)]


def test_paged_index_lists_each_sequences_pages_in_order() -> None:
    seqs = [([5, 2], 6), ([7], 4), ([0, 3, 1], 9)]  # (pages, tokens), page size 4
    slots = [s for pages, n in seqs for s in _slots(pages, 4, n)]
    indptr = [0, 6, 10, 19]
    index = paged_kv_index(indptr, torch.tensor(slots), 4)
    assert index.page_size == 4
    assert index.indptr.tolist() == [0, 2, 3, 6]
    assert index.indices.tolist() == [5, 2, 7, 0, 3, 1]
    assert index.lens.tolist() == [6, 4, 9]
    assert {t.dtype for t in (index.indptr, index.indices, index.lens)} == {torch.int32}


@pytest.mark.parametrize(
    "slots",
    [
        [4, 5, 7, 6],  # rows out of order within a page
        [5, 6, 7, 8],  # a page that does not start at row 0
        [4, 5, 6, 7, 9],  # the second page starts at row 1
    ],
)
def test_paged_index_rejects_slots_that_do_not_fill_pages(slots: list[int]) -> None:
    with pytest.raises(ValueError, match="not page-aligned"):
        paged_kv_index([0, len(slots)], torch.tensor(slots), 4)


def test_token_index_is_every_slot() -> None:
    index = token_kv_index([0, 2, 5], torch.tensor([9, 3, 4, 0, 11]))
    assert index.page_size == 1
    assert index.indptr.tolist() == [0, 2, 5] and index.lens.tolist() == [2, 3]
    assert index.indices.tolist() == [9, 3, 4, 0, 11] and index.indices.dtype == torch.int32


def test_no_chunks_without_cached_tokens() -> None:
    assert prefix_chunks([0, 3, 5], [0, 3, 5], max_tokens=8) == []


def test_prefix_chunks_cover_every_prefix_once_within_the_budget() -> None:
    qo, kv = [0, 2, 3, 6], [0, 7, 8, 18]  # prefixes 5, 0, 7
    chunks = prefix_chunks(qo, kv, max_tokens=4, groups=2)
    positions = torch.cat([c.kv_positions for c in chunks]).tolist()
    assert sorted(positions) == [0, 1, 2, 3, 4, 8, 9, 10, 11, 12, 13, 14]
    for c in chunks:
        lens = (c.kv_indptr[1:] - c.kv_indptr[:-1]).tolist()
        assert sum(lens) <= 4 and lens[1] == 0
        has = [n > 0 for n in lens]
        # rows per sequence 2, 1, 3, each repeated for 2 head groups
        want = [h for h, q in zip(has, [2, 1, 3], strict=True) for _ in range(q * 2)]
        assert c.merge_rows is not None and c.merge_rows.bool().tolist() == want
    first = chunks[0]
    assert first.kv_indptr.tolist() == [0, 4, 4, 4] and first.kv_positions.tolist() == [0, 1, 2, 3]


def test_chunk_with_keys_for_every_row_needs_no_merge_mask() -> None:
    (chunk,) = prefix_chunks([0, 1, 3], [0, 4, 8], max_tokens=100)  # prefixes 3 and 2
    assert chunk.merge_rows is None
    assert chunk.kv_indptr.tolist() == [0, 3, 5]
    assert chunk.kv_positions.tolist() == [0, 1, 2, 4, 5]


def test_plan_stage_reuses_its_buffer_and_grows_when_needed() -> None:
    stage = PlanStage(owner=1, pin=False)
    first = stage.stage([torch.tensor([0, 1, 3]), torch.tensor([5, 6], dtype=torch.int64)])
    assert [v.tolist() for v in first] == [[0, 1, 3], [5, 6]]
    assert all(v.dtype == torch.int32 for v in first)
    again = stage.stage([torch.tensor([9]), torch.tensor([8])])
    assert [v.tolist() for v in again] == [[9], [8]]
    assert again[0].data_ptr() == first[0].data_ptr()  # the same memory, no allocation
    big = stage.stage([torch.arange(40)])
    assert big[0].tolist() == list(range(40))


def test_plan_stage_made_in_inference_mode_stages_outside_it() -> None:
    with torch.inference_mode():
        stage = PlanStage(owner=1, pin=False)
        stage.stage([torch.arange(4)])
    assert stage.stage([torch.arange(3)])[0].tolist() == [0, 1, 2]
