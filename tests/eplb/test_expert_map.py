"""The logical -> physical id map: a valid replica, own rank first, in-place switch."""

from __future__ import annotations

import torch

from dsv3serve.eplb.expert_map import ExpertMap
from dsv3serve.eplb.placement import default_placement, from_phy2log, place


def test_every_choice_maps_to_a_replica_of_its_expert() -> None:
    load = torch.rand(2, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    p = place(load, 24, 4)
    ids = torch.randint(0, 16, (50, 4), generator=torch.Generator().manual_seed(1))
    ids[3] = -1
    for rank in range(4):
        m = ExpertMap(p, 4, rank, torch.device("cpu"))
        for layer in range(2):
            phys = m.to_physical(layer, ids)
            assert bool((phys[3] == -1).all())
            held = ids >= 0
            assert torch.equal(p.phy2log[layer][phys[held]], ids[held])


def test_prefers_own_rank_else_spreads() -> None:
    # 4 logical experts, 8 slots on 2 ranks: expert 0 on both ranks, expert 1 twice on rank 1
    p = from_phy2log(torch.tensor([[0, 2, 3, 0, 1, 1, 0, 3]]), 4)
    ids = torch.tensor([[0, 1], [0, 1], [0, 1], [0, 1]])
    own = ExpertMap(p, 2, 0, torch.device("cpu")).to_physical(0, ids)
    assert own[:, 0].tolist() == [0, 0, 0, 0]  # rank 0's first replica of expert 0
    assert set(own[:, 1].tolist()) == {4, 5}  # expert 1 only on rank 1: both replicas used
    other = ExpertMap(p, 2, 1, torch.device("cpu")).to_physical(0, ids)
    assert other[:, 0].tolist() == [6, 6, 6, 6]


def test_switch_in_place_keeps_buffers() -> None:
    a = default_placement(1, 8, 12, 2)
    b = place(torch.arange(1, 9, dtype=torch.float64).unsqueeze(0), 12, 2)
    m = ExpertMap(a, 2, 0, torch.device("cpu"))
    buf = m.log2phy.data_ptr()
    m.load(b)
    assert m.log2phy.data_ptr() == buf
    ids = torch.arange(8).view(4, 2)
    assert torch.equal(b.phy2log[0][m.to_physical(0, ids)], ids)
