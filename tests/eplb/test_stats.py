"""Expert-load counts equal a reference count from the router's top-k; dump round trip."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dsv3serve.eplb.stats import ExpertLoad, dump, hot_ratio, load_dump
from dsv3serve.moe.gate import grouped_topk


def test_counts_equal_router_topk_reference() -> None:
    g = torch.Generator().manual_seed(0)
    stats = ExpertLoad(layers=3, num_logical=16, device=torch.device("cpu"))
    ref = torch.zeros(3, 16, dtype=torch.int64)
    for layer in range(3):
        for batch in (5, 17):
            logits = torch.randn(batch, 16, generator=g)
            bias = torch.randn(16, generator=g) * 0.1
            _, ids = grouped_topk(logits, bias, 4, 4, 2, 2.5)
            stats.record(layer, ids)
            for e in ids.flatten().tolist():
                ref[layer, e] += 1
    assert torch.equal(stats.read(), ref)


def test_padding_ids_not_counted_and_reset() -> None:
    stats = ExpertLoad(1, 4, torch.device("cpu"))
    stats.record(0, torch.tensor([[0, 1], [-1, -1], [1, 3]]))
    assert stats.read().tolist() == [[1, 2, 0, 1]]
    stats.reset()
    assert stats.read().tolist() == [[0, 0, 0, 0]]


def test_padding_rows_past_real_not_counted() -> None:
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 8, (6, 2), generator=g)
    stats = ExpertLoad(1, 8, torch.device("cpu"))
    stats.record(0, ids, torch.tensor(4))
    assert torch.equal(stats.read()[0], torch.bincount(ids[:4].flatten(), minlength=8))


def test_hot_ratio_and_dump_round_trip(tmp_path: Path) -> None:
    counts = torch.tensor([[4, 0, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0]])
    assert hot_ratio(counts) == [4.0, 1.0, 1.0]
    path = tmp_path / "load.json"
    dump(path, counts)
    assert torch.equal(load_dump(path, 3, 4), counts.double())
    with pytest.raises(ValueError, match="shape \\[2, 4\\]"):
        load_dump(path, 2, 4)
    path.write_text("{")
    with pytest.raises(ValueError, match="expert-load dump"):
        load_dump(path, 3, 4)
