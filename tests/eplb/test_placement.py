"""EPLB placement: validity, and the max/mean rank-load table on Zipf and DeepSeek's example."""

from __future__ import annotations

import pytest
import torch

from dsv3serve.eplb.placement import (
    PlacementError,
    balanced_packing,
    default_placement,
    from_phy2log,
    imbalance,
    place,
    replicate,
)

DEEPSEEK_EXAMPLE = torch.tensor(
    [
        [90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86],
        [20, 107, 104, 64, 19, 197, 187, 157, 172, 86, 16, 27],
    ],
    dtype=torch.float64,
)


def zipf(layers: int, experts: int, s: float, seed: int) -> torch.Tensor:
    """Zipf(s) loads over experts, a random expert order per layer."""
    g = torch.Generator().manual_seed(seed)
    w = 1e5 / torch.arange(1, experts + 1, dtype=torch.float64) ** s
    return torch.stack([w[torch.randperm(experts, generator=g)] for _ in range(layers)])


def check_valid(load: torch.Tensor, phys: int, ep: int, p: object) -> None:
    assert p.phy2log.shape == (load.shape[0], phys)
    assert bool((p.logcnt >= 1).all()) and bool((p.logcnt.sum(-1) == phys).all())
    for layer in range(load.shape[0]):
        for e in range(load.shape[1]):
            slots = p.log2phy[layer, e]
            slots = slots[slots >= 0]
            assert len(slots) == int(p.logcnt[layer, e])
            assert bool((p.phy2log[layer, slots] == e).all())


# (zipf s, nodes, groups, bound after EPLB); EP8, 256 experts + 32 redundant
ZIPF_CASES = [
    (0.6, 1, 1, 1.15),
    (0.8, 1, 1, 1.15),
    (1.0, 1, 1, 1.15),
    (1.2, 1, 1, 1.15),
    (0.6, 2, 8, 1.15),
    (0.8, 2, 8, 1.15),
    (1.0, 2, 8, 1.15),
    (1.2, 2, 8, 1.15),
]


@pytest.mark.parametrize(("s", "nodes", "groups", "bound"), ZIPF_CASES)
def test_zipf_ep8_redundant32_balances(s: float, nodes: int, groups: int, bound: float) -> None:
    load = zipf(4, 256, s, seed=0)
    before = imbalance(load, default_placement(4, 256, 256, 8), 8)
    p = place(load, 288, 8, groups, nodes)
    check_valid(load, 288, 8, p)
    after = imbalance(load, p, 8)
    assert before > 1.4
    assert after <= bound, (s, nodes, before, after)


def test_hierarchical_four_nodes_still_improves() -> None:
    """Four nodes of two ranks pin 72 slots per node: less room, but never worse."""
    load = zipf(4, 256, 1.2, seed=1)
    p = place(load, 288, 8, num_groups=8, num_nodes=4)
    assert imbalance(load, p, 8) < imbalance(load, default_placement(4, 256, 256, 8), 8)


def test_deepseek_published_example() -> None:
    """2 layers, 12 experts, 16 slots, 4 groups, 2 nodes, 8 GPUs (docs/eplb.md table)."""
    p = place(DEEPSEEK_EXAMPLE, 16, 8, num_groups=4, num_nodes=2)
    check_valid(DEEPSEEK_EXAMPLE, 16, 8, p)
    before = imbalance(DEEPSEEK_EXAMPLE, default_placement(2, 12, 12, 4), 4)  # no replicas
    assert imbalance(DEEPSEEK_EXAMPLE, p, 8) < 1.25 < before
    # hierarchical: node 0 (ranks 0-3) holds whole groups of 3 experts
    for layer in range(2):
        groups = set((p.phy2log[layer, :8] // 3).tolist())
        assert len(groups) == 2


def test_replicate_and_packing() -> None:
    assert replicate([10.0, 1.0, 1.0], 5) == [3, 1, 1]
    assert sorted(map(sorted, balanced_packing([5, 4, 3, 2], 2))) == [[0, 3], [1, 2]]


def test_bad_topology_and_holes_refused() -> None:
    with pytest.raises(PlacementError, match="divisible by 8 ranks"):
        place(zipf(1, 256, 1.0, 0), 290, 8)
    with pytest.raises(PlacementError, match="held"):
        from_phy2log(torch.tensor([[0, 0, 1, 1]]), 3)
