"""The expert-parallel dispatch / combine interface (one ABC, backends chosen once).

``dispatch`` sends each token's hidden state once to every rank that owns at least one of its
top-k experts; ``combine`` brings each rank's weighted expert sum back and adds the parts up
on the token's own rank. Between the two, the caller runs its local experts on what arrived:
``sum_k weights[r, k] * expert[ids[r, k]](x[r])`` with ids local to the rank (rows whose
slot ``k`` belongs to another rank carry id ``-1`` and weight ``0`` there).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

from torch import Tensor


@dataclass
class Dispatched:
    """What arrived on this rank: ``x`` [R, H], ``topk_ids`` [R, K] int64 local expert ids
    (``-1``: not on this rank), ``topk_weights`` [R, K] float32 (0 where the id is ``-1``),
    and the backend's state for :meth:`Dispatcher.combine`."""

    x: Tensor
    topk_ids: Tensor
    topk_weights: Tensor
    state: Any = None


class Dispatcher(ABC):
    """Moves tokens to their experts' ranks and their results back.

    Every rank of the expert-parallel group calls ``dispatch`` then ``combine`` the same
    number of times, in the same order, also with zero tokens (``x`` of shape [0, H]).
    """

    num_local_experts: int
    """Routed experts each rank holds (global expert ``e`` lives on rank ``e // this``)."""

    graph_safe: ClassVar[bool] = False
    """``dispatch`` and ``combine`` can be captured into a CUDA graph (static shapes, no host
    sync, no process-group call)."""

    @abstractmethod
    def dispatch(self, x: Tensor, topk_ids: Tensor, topk_weights: Tensor) -> Dispatched:
        """``x`` [T, H], ``topk_ids`` [T, K] global expert ids, ``topk_weights`` [T, K]."""

    @abstractmethod
    def combine(self, y: Tensor, dispatched: Dispatched) -> Tensor:
        """``y`` [R, H]: this rank's weighted expert sum per received row -> [T, H] summed
        over ranks, in the token order of the matching ``dispatch``."""
