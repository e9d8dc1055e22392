"""Move expert weights between ranks to a new placement, between steps.

Every rank computes the same transfer list from the old and new ``phy2log`` rows: a new slot
whose expert the rank already held is copied locally; otherwise one holder (chosen by slot
index among the old holders) sends it point to point (tag = slot). Sources are snapshotted
first, so slots may be overwritten in any order. After every layer moved, a barrier, then
each rank switches its :class:`ExpertMap` in place: no step runs between the first move and
the switch, so every step sees one consistent map on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from dsv3serve.eplb.placement import Placement
from dsv3serve.eplb.state import EplbState


@dataclass
class Moves:
    """One rank's part of one layer's transfer, in local slots."""

    copies: list[tuple[int, int]] = field(default_factory=list)  # (dst, src)
    sends: list[tuple[int, int, int]] = field(default_factory=list)  # (peer, src, tag)
    recvs: list[tuple[int, int, int]] = field(default_factory=list)  # (peer, dst, tag)


def loaded_phy2log(layers: int, num_logical: int, num_physical: int, ep: int) -> torch.Tensor:
    """What the loader leaves: rank ``r`` holds ``r*E/ep ..`` then empty (-1) slots."""
    per, slots = num_logical // ep, num_physical // ep
    row = [r * per + i if i < per else -1 for r in range(ep) for i in range(slots)]
    return torch.tensor([row] * layers, dtype=torch.int64)


def plan_moves(old: list[int], new: list[int], ep: int, rank: int) -> Moves:
    """This rank's copies, sends and receives taking one layer from ``old`` to ``new``."""
    slots = len(new) // ep
    first: list[dict[int, int]] = [{} for _ in range(ep)]  # rank -> expert -> first slot
    for p, e in enumerate(old):
        if e >= 0:
            first[p // slots].setdefault(e, p % slots)
    moves = Moves()
    for p, e in enumerate(new):
        dst_rank, dst = divmod(p, slots)
        if e in first[dst_rank]:
            if dst_rank == rank and old[p] != e:
                moves.copies.append((dst, first[rank][e]))
            continue
        holders = [r for r in range(ep) if e in first[r]]
        if not holders:
            raise ValueError(f"expert {e} of the new placement is held by no rank")
        src_rank = holders[p % len(holders)]
        if src_rank == rank:
            moves.sends.append((dst_rank, first[rank][e], p))
        if dst_rank == rank:
            moves.recvs.append((src_rank, dst, p))
    return moves


def move_layer(params: list[torch.Tensor], moves: Moves, group: dist.ProcessGroup | None) -> None:
    """Apply ``moves`` to this rank's stacked tensors ``params`` (each [slots, ...]; weights
    and scales of one layer), collective with the peers named in ``moves``."""
    srcs = sorted({s for _, s in moves.copies} | {s for _, s, _ in moves.sends})
    snap = {s: [t[s].clone() for t in params] for s in srcs}
    ops, inbox = [], []
    for peer, dst, tag in moves.recvs:
        bufs = [torch.empty_like(t[dst]) for t in params]
        ops += [dist.P2POp(dist.irecv, b, _global(peer, group), group, tag) for b in bufs]
        inbox.append((dst, bufs))
    for peer, src, tag in moves.sends:
        ops += [dist.P2POp(dist.isend, b, _global(peer, group), group, tag) for b in snap[src]]
    # one batch: NCCL ignores tags and runs a rank's unbatched sends and receives in order
    # on one stream, so two ranks that each receive before they send wait for each other
    # forever (the hang of bench_eplb.py on two H200s, 2026-11-29); a batch runs them together
    for r in dist.batch_isend_irecv(ops) if ops else []:
        r.wait()
    for dst, src in moves.copies:
        for t, s in zip(params, snap[src], strict=True):
            t[dst].copy_(s)
    for dst, bufs in inbox:
        for t, b in zip(params, bufs, strict=True):
            t[dst].copy_(b)


def _global(peer: int, group: dist.ProcessGroup | None) -> int:
    return peer if group is None else dist.get_global_rank(group, peer)


def rebalance(
    stacks: list[list[torch.Tensor]],
    state: EplbState,
    old: torch.Tensor,
    new: Placement,
    group: dist.ProcessGroup | None = None,
) -> None:
    """Move every MoE layer's stacked tensors ``stacks[i]`` (row ``i``) from ``old`` [L, P]
    (-1: empty slot) to ``new``, then switch the map. Every rank of the EP group calls it
    between steps."""
    ep, rank = dist.get_world_size(group), dist.get_rank(group)
    if len(stacks) != new.phy2log.shape[0] or old.shape != new.phy2log.shape:
        raise ValueError(
            f"expected {len(stacks)} layers of {list(old.shape)}, got {list(new.phy2log.shape)}"
        )
    for row, params in enumerate(stacks):
        moves = plan_moves(old[row].tolist(), new.phy2log[row].tolist(), ep, rank)
        move_layer(params, moves, group)
    dist.barrier(group)
    state.expert_map.load(new)
