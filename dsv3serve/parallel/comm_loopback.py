"""A one-process stand-in for an N-rank group's collectives, FOR TIMING ONLY.

:class:`LoopbackTimingOnlyComm` lets one GPU build and run rank ``rank``'s shard of an
``world_size``-rank layout: every collective returns a tensor of the shape the real one would
(``all_gather`` repeats the local tensor ``world_size`` times), with no communication and no
host sync, so CUDA graphs can capture it. The VALUES are not the group's: sums are not summed
and gathered parts are copies of this rank's. Use it to time one rank's share of the work,
never for outputs.
"""

from __future__ import annotations

import torch
from torch import Tensor

from dsv3serve.parallel.comm import Comm


class LoopbackTimingOnlyComm(Comm):
    """FOR TIMING ONLY: rank ``rank`` of a pretend group of ``world_size`` ranks.

    ``all_reduce`` returns ``x`` unchanged; ``all_gather`` [.., n, ..] -> [.., world * n, ..]
    (``x`` repeated); ``all_gather_rows`` [n, ...] -> ([world * n, ...], [n] * world), the
    counts known on the host without a sync; ``reduce_scatter_rows`` keeps the first block;
    ``all_to_all_rows`` returns ``x``.
    """

    graph_safe: bool = True

    def __init__(self, world_size: int, rank: int) -> None:
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(
                f"expected world_size >= 1 and 0 <= rank < world_size, got world_size "
                f"{world_size}, rank {rank}"
            )
        self._world, self._rank = world_size, rank

    @property
    def world_size(self) -> int:
        return self._world

    @property
    def rank(self) -> int:
        return self._rank

    def all_reduce(self, x: Tensor) -> Tensor:
        return x

    def all_gather(self, x: Tensor, dim: int) -> Tensor:
        return torch.cat([x] * self._world, dim=dim)

    def all_gather_rows(self, x: Tensor) -> tuple[Tensor, list[int]]:
        return self.all_gather(x, 0), [x.shape[0]] * self._world

    def reduce_scatter_rows(self, x: Tensor) -> Tensor:
        return x[: x.shape[0] // self._world]

    def all_to_all_rows(self, x: Tensor) -> Tensor:
        return x
