"""Splitting a DP spec forward by rank and putting the ranks' outputs back in call order."""

from __future__ import annotations

import pytest
import torch

from dsv3serve.engine.speculative.dp_group import (
    SpanSplit,
    decode,
    encode,
    route_rows,
    sampled_order,
)
from dsv3serve.forward_batch import SeqSpan


def spans_of(lengths: list[int], samples: list[bool]) -> list[SeqSpan]:
    return [
        SeqSpan(list(range(n)), 0, page_table=[0], page_size=8, sample=s)
        for n, s in zip(lengths, samples, strict=True)
    ]


def test_rows_go_to_their_rank_and_come_back_in_order() -> None:
    spans = spans_of([2, 3, 1, 4], [True] * 4)
    split = SpanSplit.of(spans, [1, 0, 1, 0], ranks=2)
    assert split.by_rank == [[1, 3], [0, 2]]
    rows = [0, 1, 2, 4, 5, 6, 9]
    local, order = route_rows(split, rows, ranks=2)
    # rank 0 holds spans 1 (call rows 2-4) then 3 (rows 6-9); rank 1 spans 0 (0-1), 2 (5)
    assert local == [[0, 2, 3, 6], [0, 1, 2]]
    outputs = [torch.tensor([2, 4, 6, 9]), torch.tensor([0, 1, 5])]  # each rank's rows' ids
    assert torch.cat(outputs)[order].tolist() == rows
    assert split.token_rows(spans, 0) == [2, 3, 4, 6, 7, 8, 9]


def test_sampled_spans_come_back_in_call_order() -> None:
    spans = spans_of([1, 1, 1, 1, 1], [True, False, True, True, True])
    split = SpanSplit.of(spans, [0, 1, 1, 0, 1], ranks=3)
    counts, order = sampled_order(split, spans, ranks=3)
    assert counts == [2, 2, 0]  # rank 2 idles
    per_rank = [torch.tensor([0, 3]), torch.tensor([2, 4]), torch.tensor([], dtype=torch.long)]
    assert torch.cat(per_rank)[order].tolist() == [0, 2, 3, 4]


def test_payload_round_trips_per_rank() -> None:
    spans = spans_of([2, 1], [True, False])
    data = encode(1, [[1], [], [0]], [[spans[0]], [], [spans[1]]], [1, 0, 1])
    flag, rows, got, out = decode(data, 2)
    assert (flag, rows, out) == (1, [0], [1, 0, 1])
    assert [(s.token_ids, s.sample) for s in got] == [([0], False)]
    assert decode(data, 1)[1:3] == ([], [])


def test_an_owner_per_span_is_required() -> None:
    with pytest.raises(ValueError, match="expected an owner per span"):
        SpanSplit.of(spans_of([1, 1], [True, True]), [0], ranks=2)
