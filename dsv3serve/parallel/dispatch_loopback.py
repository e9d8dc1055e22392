"""Dispatchers without collectives: the identity for ``ep_size`` 1, and a one-rank loopback
that exists only to time one EP rank's share of the work on a single GPU."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from dsv3serve.parallel.dispatch_base import Dispatched, Dispatcher
from dsv3serve.parallel.dispatch_pack import (
    RoutePlan,
    WireFormat,
    check_payload_dtype,
    check_routing,
    sum_back,
)


class NoDispatch(Dispatcher):
    """``ep_size`` 1: every expert is local, nothing moves. ``dispatch`` returns the tokens as
    they are (ids int64, weights float32); ``combine`` returns ``y``."""

    graph_safe: ClassVar[bool] = True

    def __init__(self, num_experts: int) -> None:
        self.num_local_experts = num_experts

    def dispatch(self, x: Tensor, topk_ids: Tensor, topk_weights: Tensor) -> Dispatched:
        check_routing(x, topk_ids, topk_weights)
        return Dispatched(x, topk_ids.long(), topk_weights.float(), state=x.shape[0])

    def combine(self, y: Tensor, dispatched: Dispatched) -> Tensor:
        if y.shape[0] != dispatched.state:
            raise ValueError(f"expected y with {dispatched.state} rows, got {y.shape[0]}")
        return y


@dataclass(frozen=True)
class _LoopbackState:
    src_token: Tensor
    num_tokens: int


class LoopbackTimingOnlyDispatcher(Dispatcher):
    """FOR TIMING ONLY -- NOT a correct multi-rank MoE.

    Pretends to be EP rank ``rank`` of ``ep_size`` in a one-process run: ``dispatch`` keeps,
    of each token's top-k, only the experts in this rank's range (the others are dropped, and
    no other rank's tokens arrive), and moves the tokens through the same pack / unpack path
    as :class:`~dsv3serve.parallel.dispatch_a2a.AllToAllDispatcher`, with a local copy where
    the collective would be. ``combine`` returns [T, H]: this rank's part of each token,
    zeros for tokens routed elsewhere. A one-GPU benchmark of one EP rank's share of the model
    thus times the local expert work of this rank's own tokens; its outputs are not the
    model's.

    CUDA-graph safe (no host sync, static shapes): EVERY token arrives as one row, those with
    no expert here with all ids ``-1`` and weights 0 (the all-to-all would not send them;
    the caller clamps their ``-1`` slots to local expert 0 with weight 0, so the fused MoE
    still runs those rows through expert 0: extra work the all-to-all path has too, reported
    as ``kernel_extra_bytes`` by the EP-rank benchmark).
    """

    graph_safe: ClassVar[bool] = True

    def __init__(
        self, num_experts: int, ep_size: int, rank: int, payload_dtype: torch.dtype | None = None
    ) -> None:
        if num_experts % ep_size or not 0 <= rank < ep_size:
            raise ValueError(
                f"expected num_experts divisible by ep_size and 0 <= rank < ep_size, got "
                f"num_experts {num_experts}, ep_size {ep_size}, rank {rank}"
            )
        self.ep_size = ep_size
        self.rank = rank
        self.num_local_experts = num_experts // ep_size
        self.payload_dtype = check_payload_dtype(payload_dtype)

    def local_routes(self, topk_ids: Tensor, topk_weights: Tensor) -> RoutePlan:
        """Every token once, ids local to this rank (``-1``, weight 0, for other ranks')."""
        local = topk_ids - self.rank * self.num_local_experts
        here = (topk_ids >= 0) & (local >= 0) & (local < self.num_local_experts)
        src = torch.arange(topk_ids.shape[0], device=topk_ids.device)
        ids = torch.where(here, local, -1).to(torch.int32)
        return RoutePlan(src, ids, torch.where(here, topk_weights.float(), 0.0))

    def dispatch(self, x: Tensor, topk_ids: Tensor, topk_weights: Tensor) -> Dispatched:
        check_routing(x, topk_ids, topk_weights)
        plan = self.local_routes(topk_ids, topk_weights)
        wire = WireFormat(x.shape[1], topk_ids.shape[1], x.dtype, self.payload_dtype)
        arrived = wire.pack(x, plan).clone()  # stands in for the all-to-all
        state = _LoopbackState(plan.src_token, x.shape[0])
        return Dispatched(*wire.unpack(arrived), state=state)

    def combine(self, y: Tensor, dispatched: Dispatched) -> Tensor:
        s: _LoopbackState = dispatched.state
        if y.shape[0] != s.src_token.shape[0]:
            raise ValueError(f"expected y with {s.src_token.shape[0]} rows, got {y.shape[0]}")
        return sum_back(y.clone(), s.src_token, s.num_tokens)  # clone: the return trip
