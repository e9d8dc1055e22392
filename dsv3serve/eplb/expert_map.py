"""Logical -> physical expert ids on the device: the one mapping every dispatcher uses.

The router picks logical experts; each has one or more physical replicas (slot ``p`` lives on
rank ``p // slots_per_rank``). :func:`to_physical` picks one replica per choice: a replica on
the token's own rank when there is one, else replica ``(token + k) % count`` to spread the
load. Pure tensor ops on ``log2phy`` (a device tensor): no host sync, CUDA-graph safe, and a
new map is switched in by ``copy_`` into the same buffers (:class:`ExpertMap.load`).
"""

from __future__ import annotations

import torch

from dsv3serve.eplb.placement import Placement


class ExpertMap:
    """Device buffers of one placement for every MoE layer, updated in place.

    ``log2phy`` [L, E, R_max] int64 (-1 padded) and ``logcnt`` [L, E] int64. ``R_max`` is
    fixed at construction (the most replicas any expert can have: redundant slots + 1), so a
    rebalanced placement fits the same buffers and captured graphs keep reading them.
    """

    def __init__(self, placement: Placement, ep_size: int, rank: int, device: torch.device) -> None:
        layers, logical = placement.logcnt.shape
        max_rep = placement.num_physical - placement.num_logical + 1
        self.slots_per_rank = placement.num_physical // ep_size
        self.rank = rank
        self.log2phy = torch.full((layers, logical, max_rep), -1, dtype=torch.int64, device=device)
        self.logcnt = torch.ones((layers, logical), dtype=torch.int64, device=device)
        self.placement = placement
        self.load(placement)

    def load(self, placement: Placement) -> None:
        """Switch to ``placement`` (same layer, logical and physical counts) in place."""
        padded = torch.full_like(self.log2phy, -1, device="cpu")
        padded[:, :, : placement.log2phy.shape[2]] = placement.log2phy
        self.log2phy.copy_(padded)
        self.logcnt.copy_(placement.logcnt)
        self.placement = placement

    def local_slots(self) -> torch.Tensor:
        """[L, slots_per_rank] logical ids this rank's physical slots hold (host tensor)."""
        start = self.rank * self.slots_per_rank
        return self.placement.phy2log[:, start : start + self.slots_per_rank]

    def to_physical(self, layer: int, ids: torch.Tensor) -> torch.Tensor:
        """Logical ids [T, K] of MoE layer ``layer`` -> physical ids [T, K] (see module)."""
        return to_physical(
            ids, self.log2phy[layer], self.logcnt[layer], self.slots_per_rank, self.rank
        )


def to_physical(
    ids: torch.Tensor, log2phy: torch.Tensor, logcnt: torch.Tensor, slots_per_rank: int, rank: int
) -> torch.Tensor:
    """Logical ids [T, K] (``-1``: routed nowhere, kept) -> physical ids [T, K].

    ``log2phy`` [E, R] (-1 padded), ``logcnt`` [E]. Prefers the lowest replica on ``rank``;
    otherwise replica ``(t + k) % logcnt[e]`` for token row ``t``, choice ``k``."""
    safe = ids.clamp_min(0)
    cands = log2phy[safe]  # [T, K, R]
    on_rank = (cands >= 0) & (cands // slots_per_rank == rank)
    t = torch.arange(ids.shape[0], device=ids.device).unsqueeze(1)
    k = torch.arange(ids.shape[1], device=ids.device).unsqueeze(0)
    spread = (t + k) % logcnt[safe]
    pick = torch.where(on_rank.any(-1), on_rank.int().argmax(-1), spread)
    phys = torch.gather(cands, 2, pick.unsqueeze(-1)).squeeze(-1)
    return torch.where(ids >= 0, phys, ids)
