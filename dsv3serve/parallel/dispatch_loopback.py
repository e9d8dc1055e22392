"""Dispatchers without collectives: the identity for ``ep_size`` 1, and a one-rank loopback
that exists only to time one EP rank's share of the work on a single GPU."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from dsv3serve.parallel.dispatch_base import Dispatched, Dispatcher
from dsv3serve.parallel.dispatch_pack import (
    WireFormat,
    check_payload_dtype,
    check_routing,
    copy_mask,
    plan_routes,
    sum_back,
)


class NoDispatch(Dispatcher):
    """``ep_size`` 1: every expert is local, nothing moves. ``dispatch`` returns the tokens as
    they are (ids int64, weights float32); ``combine`` returns ``y``."""

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

    Pretends to be EP rank ``rank`` of ``ep_size`` in a one-process run: ``dispatch`` keeps
    only the tokens with at least one expert in this rank's range (their other experts are
    dropped, and no other rank's tokens arrive), and moves them through the same pack / unpack
    path as :class:`~dsv3serve.parallel.dispatch_a2a.AllToAllDispatcher`, with a local copy
    where the collective would be. ``combine`` returns [T, H]: this rank's part of each token,
    zeros for tokens routed elsewhere. A one-GPU benchmark of one EP rank's share of the model
    thus times realistic local expert work; its outputs are not the model's.

    One host sync per ``dispatch`` (the copy counts), none in ``combine``.
    """

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

    def dispatch(self, x: Tensor, topk_ids: Tensor, topk_weights: Tensor) -> Dispatched:
        check_routing(x, topk_ids, topk_weights)
        mask = copy_mask(topk_ids, self.num_local_experts, self.ep_size)
        counts = mask.sum(0).tolist()  # the one host sync
        plan = plan_routes(topk_ids, topk_weights, self.num_local_experts, mask, sum(counts))
        first, rows = sum(counts[: self.rank]), counts[self.rank]
        wire = WireFormat(x.shape[1], topk_ids.shape[1], x.dtype, self.payload_dtype)
        arrived = wire.pack(x, plan, first, rows).clone()  # stands in for the all-to-all
        state = _LoopbackState(plan.src_token[first : first + rows], x.shape[0])
        return Dispatched(*wire.unpack(arrived), state=state)

    def combine(self, y: Tensor, dispatched: Dispatched) -> Tensor:
        s: _LoopbackState = dispatched.state
        if y.shape[0] != s.src_token.shape[0]:
            raise ValueError(f"expected y with {s.src_token.shape[0]} rows, got {y.shape[0]}")
        return sum_back(y.clone(), s.src_token, s.num_tokens)  # clone: the return trip
