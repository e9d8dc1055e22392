"""The collectives a sharded forward needs, over one torch.distributed process group.

:class:`GroupComm` runs them over a group (the default world when none is given);
:class:`SingleRank` has the same API and does nothing, for a group of one rank. Every call
is collective: each rank of the group makes the same calls in the same order.

Only :meth:`Comm.all_gather_rows` syncs the host (it reads the gathered row counts to pad
and to slice), and not inside :func:`~dsv3serve.parallel.uniform.uniform_batch`, where every
rank's count is the agreed one; the other collectives stay on the device.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
import torch.distributed as dist
from torch import Tensor

from dsv3serve.parallel.uniform import check_uniform, uniform_rows


class Comm(ABC):
    """Collectives of one group: sum, equal-size gather and gather of varying row counts.

    ``graph_safe``: every collective can be captured into a CUDA graph (no host sync, and a
    backend whose kernels a graph can record: NCCL, or nothing crossing processes), given
    that ``all_gather_rows`` runs inside a uniform batch.
    """

    graph_safe: bool = False

    @property
    @abstractmethod
    def world_size(self) -> int:
        """Ranks in the group."""

    @property
    @abstractmethod
    def rank(self) -> int:
        """This rank's index in the group."""

    @abstractmethod
    def all_reduce(self, x: Tensor) -> Tensor:
        """Sum ``x`` over the group, in place; returns ``x``."""

    @abstractmethod
    def all_gather(self, x: Tensor, dim: int) -> Tensor:
        """Concatenate every rank's ``x`` (equal shapes) along ``dim``, in rank order."""

    @abstractmethod
    def all_gather_rows(self, x: Tensor) -> tuple[Tensor, list[int]]:
        """Gather ``x`` [n_r, ...] whose row count differs per rank.

        Returns ``(rows, counts)``: ``rows`` [world * max(counts), ...] holds rank ``r``'s
        rows at ``r * max(counts) .. + counts[r]`` (the rest is zero padding), ``counts`` the
        row count of every rank. Syncs the host (one all_gather of the counts first), except
        inside a uniform batch, where every count is the agreed one.
        """

    @abstractmethod
    def reduce_scatter_rows(self, x: Tensor) -> Tensor:
        """Sum ``x`` [world * n, ...] over the group and keep this rank's block of ``n`` rows
        (rows ``rank * n .. (rank + 1) * n``): [n, ...]."""

    @abstractmethod
    def all_to_all_rows(self, x: Tensor) -> Tensor:
        """Send row block ``s`` of ``x`` [world * n, ...] to rank ``s``: returns [world * n,
        ...] whose block ``r`` is the block rank ``r`` sent here (equal blocks, no host sync)."""


class SingleRank(Comm):
    """A group of one rank: every collective returns its input."""

    graph_safe: bool = True

    @property
    def world_size(self) -> int:
        return 1

    @property
    def rank(self) -> int:
        return 0

    def all_reduce(self, x: Tensor) -> Tensor:
        return x

    def all_gather(self, x: Tensor, dim: int) -> Tensor:
        return x

    def all_gather_rows(self, x: Tensor) -> tuple[Tensor, list[int]]:
        return x, [x.shape[0]]

    def reduce_scatter_rows(self, x: Tensor) -> Tensor:
        return x

    def all_to_all_rows(self, x: Tensor) -> Tensor:
        return x


class GroupComm(Comm):
    """Collectives over ``group`` (None: the default world group, which must be initialised)."""

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        if not dist.is_initialized():
            raise RuntimeError("GroupComm needs torch.distributed initialised (init_process_group)")
        self.group = group
        self.backend = dist.get_backend(group)
        self.graph_safe = self.backend == "nccl"

    @property
    def world_size(self) -> int:
        return dist.get_world_size(self.group)

    @property
    def rank(self) -> int:
        return dist.get_rank(self.group)

    def all_reduce(self, x: Tensor) -> Tensor:
        dist.all_reduce(x, op=dist.ReduceOp.SUM, group=self.group)
        return x

    def all_gather(self, x: Tensor, dim: int) -> Tensor:
        if dim == 0:  # straight into one buffer: no per-rank parts to concatenate
            out = x.new_empty((self.world_size * x.shape[0], *x.shape[1:]))
            dist.all_gather_into_tensor(out, x.contiguous(), group=self.group)
            return out
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=dim)

    def all_gather_rows(self, x: Tensor) -> tuple[Tensor, list[int]]:
        if uniform_rows() is not None:
            n = check_uniform(x.shape[0], "all_gather_rows")
            return self.all_gather(x, 0), [n] * self.world_size
        count = torch.tensor([x.shape[0]], dtype=torch.int64, device=x.device)
        counts = [int(c) for c in self.all_gather(count, 0).tolist()]  # host sync
        most = max(counts)
        padded = x.new_zeros((most, *x.shape[1:]))
        padded[: x.shape[0]] = x
        return self.all_gather(padded, 0), counts

    def reduce_scatter_rows(self, x: Tensor) -> Tensor:
        world = self.world_size
        if x.shape[0] % world:
            raise ValueError(f"expected rows divisible by the {world} ranks, got {x.shape[0]}")
        n = x.shape[0] // world
        if self.backend != "nccl":  # gloo has no reduce_scatter: sum everything, keep a block
            summed = x.clone()
            dist.all_reduce(summed, op=dist.ReduceOp.SUM, group=self.group)
            return summed[self.rank * n : (self.rank + 1) * n]
        out = x.new_empty((n, *x.shape[1:]))
        dist.reduce_scatter_tensor(out, x.contiguous(), op=dist.ReduceOp.SUM, group=self.group)
        return out

    def all_to_all_rows(self, x: Tensor) -> Tensor:
        if x.shape[0] % self.world_size:
            raise ValueError(
                f"expected rows divisible by the {self.world_size} ranks, got {x.shape[0]}"
            )
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x.contiguous(), group=self.group)
        return out


def make_comm(group: dist.ProcessGroup | None = None) -> Comm:
    """:class:`SingleRank` when torch.distributed is off or the group has one rank, else a
    :class:`GroupComm` over ``group``."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return SingleRank()
    return GroupComm(group)
