"""Expert placement over redundant slots, after DeepSeek's published EPLB description.

Given each layer's load per logical expert, place ``num_physical`` expert slots
(logical experts plus redundant copies) on ``num_gpus`` ranks so the busiest rank's load is
close to the mean. A replica's load is its expert's load split evenly over the replicas.

Hierarchical (when the expert groups divide evenly over the nodes): pack the expert groups
onto nodes by group load, replicate hot experts inside each node into that node's share of
the slots, then pack the node's physical experts onto its GPUs. Global: one node, one group.
Planning runs on the host (a handful of ms per layer); only its result is used on the device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


class PlacementError(ValueError):
    """The topology cannot hold the requested placement (numbers in the message)."""


@dataclass(frozen=True)
class Placement:
    """One placement for every MoE layer.

    ``phy2log`` [L, P] int64: the logical expert each physical slot holds (slot ``p`` lives
    on rank ``p // (P / ep)``). ``log2phy`` [L, E, R] int64: each logical expert's physical
    slots, ``-1`` padded. ``logcnt`` [L, E] int64: each logical expert's replica count (>= 1).
    """

    phy2log: torch.Tensor
    log2phy: torch.Tensor
    logcnt: torch.Tensor

    @property
    def num_physical(self) -> int:
        return int(self.phy2log.shape[1])

    @property
    def num_logical(self) -> int:
        return int(self.logcnt.shape[1])


def balanced_packing(weights: list[float], num_bins: int) -> list[list[int]]:
    """Split items into ``num_bins`` bins of equal item count, heaviest item first into the
    lightest bin that still has room. Returns each bin's item indices."""
    if len(weights) % num_bins:
        raise PlacementError(f"expected items divisible by {num_bins} bins, got {len(weights)}")
    room = len(weights) // num_bins
    bins: list[list[int]] = [[] for _ in range(num_bins)]
    loads = [0.0] * num_bins
    for item in sorted(range(len(weights)), key=lambda i: -weights[i]):
        open_bins = [b for b in range(num_bins) if len(bins[b]) < room]
        b = min(open_bins, key=lambda j: loads[j])
        bins[b].append(item)
        loads[b] += weights[item]
    return bins


def replicate(weights: list[float], num_slots: int) -> list[int]:
    """Replica counts per expert summing to ``num_slots``: each extra slot goes to the expert
    whose per-replica load is then the highest."""
    if num_slots < len(weights):
        raise PlacementError(f"expected at least {len(weights)} slots, got {num_slots}")
    counts = [1] * len(weights)
    for _ in range(num_slots - len(weights)):
        hot = max(range(len(weights)), key=lambda e: weights[e] / counts[e])
        counts[hot] += 1
    return counts


def _place_node(experts: list[int], load: list[float], slots: int, gpus: int) -> list[int]:
    """Physical slots (logical ids, GPU-major) for one node holding ``experts``."""
    counts = replicate([load[e] for e in experts], slots)
    replicas = [e for e, n in zip(experts, counts, strict=True) for _ in range(n)]
    share = {e: load[e] / n for e, n in zip(experts, counts, strict=True)}
    bins = balanced_packing([share[e] for e in replicas], gpus)
    return [replicas[i] for b in bins for i in sorted(b, key=lambda i: replicas[i])]


def place_layer(
    load: list[float], num_physical: int, num_groups: int, num_nodes: int, num_gpus: int
) -> list[int]:
    """``phy2log`` of one layer (see :func:`place`)."""
    e = len(load)
    _check(e, num_physical, num_groups, num_nodes, num_gpus)
    per_group = e // num_groups
    groups = [list(range(g * per_group, (g + 1) * per_group)) for g in range(num_groups)]
    group_load = [sum(load[x] for x in g) for g in groups]
    out: list[int] = []
    for node_groups in balanced_packing(group_load, num_nodes):
        experts = sorted(x for g in node_groups for x in groups[g])
        out += _place_node(experts, load, num_physical // num_nodes, num_gpus // num_nodes)
    return out


def _check(e: int, phys: int, groups: int, nodes: int, gpus: int) -> None:
    if phys < e or phys % gpus:
        raise PlacementError(
            f"expected >= {e} physical slots divisible by {gpus} ranks, got {phys}"
        )
    if e % groups or groups % nodes or gpus % nodes or (phys // nodes) < e // nodes:
        raise PlacementError(
            f"expected {e} experts in {groups} groups divisible over {nodes} nodes "
            f"and {gpus} ranks over the nodes"
        )


def place(
    load: torch.Tensor,
    num_physical: int,
    num_gpus: int,
    num_groups: int = 1,
    num_nodes: int = 1,
) -> Placement:
    """Placement for ``load`` [L, E] (tokens per logical expert per layer).

    Hierarchical when ``num_groups`` is a multiple of ``num_nodes`` > 1 (groups packed to
    nodes first); otherwise global (one node, one group)."""
    if load.dim() != 2:
        raise PlacementError(f"expected load of shape [layers, experts], got {list(load.shape)}")
    if num_nodes <= 1 or num_groups % num_nodes:
        num_groups, num_nodes = 1, 1
    rows = [place_layer(r, num_physical, num_groups, num_nodes, num_gpus) for r in load.tolist()]
    return from_phy2log(torch.tensor(rows, dtype=torch.int64), int(load.shape[1]))


def from_phy2log(phy2log: torch.Tensor, num_logical: int) -> Placement:
    """The full :class:`Placement` of ``phy2log`` [L, P]; every logical expert must appear."""
    layers = int(phy2log.shape[0])
    logcnt = torch.zeros(layers, num_logical, dtype=torch.int64)
    logcnt.scatter_add_(1, phy2log, torch.ones_like(phy2log))
    if bool((logcnt == 0).any()) or int(phy2log.min()) < 0 or int(phy2log.max()) >= num_logical:
        raise PlacementError(f"expected every logical expert 0..{num_logical - 1} held, got holes")
    log2phy = torch.full((layers, num_logical, int(logcnt.max())), -1, dtype=torch.int64)
    for layer, row in enumerate(phy2log.tolist()):
        seen = [0] * num_logical
        for p, e in enumerate(row):
            log2phy[layer, e, seen[e]] = p
            seen[e] += 1
    return Placement(phy2log=phy2log, log2phy=log2phy, logcnt=logcnt)


def default_placement(layers: int, num_logical: int, num_physical: int, ep: int) -> Placement:
    """Today's layout plus redundant slots: rank ``r`` holds logical experts
    ``r*E/ep ..`` in order, then its share of redundant slots filled round-robin."""
    if num_logical % ep or num_physical % ep or num_physical < num_logical:
        raise PlacementError(
            f"expected {num_logical} experts and {num_physical} slots divisible by ep {ep}"
        )
    per, extra = num_logical // ep, (num_physical - num_logical) // ep
    row: list[int] = []
    for r in range(ep):
        row += list(range(r * per, (r + 1) * per))
        row += [(r * extra + i) % num_logical for i in range(extra)]
    return from_phy2log(torch.tensor([row] * layers, dtype=torch.int64), num_logical)


def rank_loads(load: torch.Tensor, placement: Placement, ep: int) -> torch.Tensor:
    """[L, ep] float: each rank's share of ``load`` [L, E] under ``placement`` (a replica
    takes its expert's load over the replica count)."""
    share = load.double() / placement.logcnt.double()
    per_slot = torch.gather(share, 1, placement.phy2log)
    return per_slot.view(per_slot.shape[0], ep, -1).sum(-1)


def imbalance(load: torch.Tensor, placement: Placement, ep: int) -> float:
    """Max over layers of (busiest rank / mean rank) load."""
    ranks = rank_loads(load, placement, ep)
    return float((ranks.max(-1).values / ranks.mean(-1).clamp_min(1e-12)).max())
