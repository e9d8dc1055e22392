"""Expert-parallel dispatch / combine over ``torch.distributed.all_to_all_single``.

Works wherever the process group's backend has ``all_to_all_single`` with uneven splits:
gloo on CPU, NCCL on GPU (tensors on the rank's device). Rows travel as bytes
(:class:`~dsv3serve.parallel.dispatch_pack.WireFormat`), so bf16, fp32 and fp8 payloads all
take the same path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from dsv3serve.parallel.dispatch_base import Dispatched, Dispatcher
from dsv3serve.parallel.dispatch_meter import DispatchMeter
from dsv3serve.parallel.dispatch_pack import (
    WireFormat,
    check_payload_dtype,
    check_routing,
    copy_mask,
    plan_routes,
    sum_back,
)


@dataclass(frozen=True)
class A2AState:
    """What :meth:`AllToAllDispatcher.combine` needs from its ``dispatch``: the source token of
    each sent copy [S] and the split sizes (host ints) of both directions."""

    src_token: Tensor
    send_counts: list[int]
    recv_counts: list[int]
    num_tokens: int


class AllToAllDispatcher(Dispatcher):
    """Dispatch / combine over ``all_to_all_single`` of the group ``group`` (None: the world).

    ``dispatch`` makes one copy of each token per rank that owns at least one of its top-k
    experts (global expert ``e`` on group rank ``e // num_local_experts``) and runs two
    collectives: the per-rank copy counts ([W] int64), then one byte buffer carrying, per
    copy, the hidden row with its top-k weights (float32) and local ids (int32, ``-1`` and
    weight 0 for slots on other ranks) -- see ``dispatch_pack``. With ``payload_dtype``
    ``torch.float8_e4m3fn`` the rows are quantised per token per 128 channels before sending
    (scales sent with them) and dequantised on arrival to the input dtype.

    ``combine`` sends the [R, H] results back by the inverse splits (one collective, in
    ``y``'s dtype) and adds each token's parts in float32 with ``index_add_``.

    Host syncs: one per ``dispatch`` (the sent and received counts, read together, give the
    split sizes; it keeps ``dispatch`` out of CUDA graphs); none in ``combine``. Routing ids
    ``< 0`` are slots with no expert; ids are not range-checked (that would cost a sync).
    Every rank must use the same hidden size and dtype; zero tokens on a rank, and ranks that
    receive nothing, are fine.

    ``meter`` (mode ``a2a``): per call, the received rows times the wire row (hidden payload,
    FP8 scales, top-k weights and ids, padded) for dispatch, the rows sent back times ``y``'s
    row for combine; all host ints (the split sizes). ``metered=False``: the meter is off.
    """

    meter: DispatchMeter

    def __init__(
        self,
        num_experts: int,
        group: dist.ProcessGroup | None = None,
        payload_dtype: torch.dtype | None = None,
        metered: bool = True,
    ) -> None:
        self.group = group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        if num_experts % self.world:
            raise ValueError(
                f"num_experts {num_experts} must divide over the {self.world} ranks of the group"
            )
        self.num_experts = num_experts
        self.num_local_experts = num_experts // self.world
        self.payload_dtype = check_payload_dtype(payload_dtype)
        self.meter = DispatchMeter(self.rank, enabled=metered)

    def _exchange_counts(self, send_counts: Tensor) -> tuple[list[int], list[int]]:
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=self.group)
        both = torch.stack([send_counts, recv_counts]).tolist()  # the one host sync
        return both[0], both[1]

    def _exchange(
        self, send: Tensor, rows_out: int, out_splits: list[int], in_splits: list[int]
    ) -> Tensor:
        recv = send.new_empty(rows_out, *send.shape[1:])
        dist.all_to_all_single(recv, send, out_splits, in_splits, group=self.group)
        return recv

    def dispatch(self, x: Tensor, topk_ids: Tensor, topk_weights: Tensor) -> Dispatched:
        """``x`` [T, H] (bf16 / fp32 / ...), ``topk_ids`` [T, K] global ids, ``topk_weights``
        [T, K] -> rows for this rank's experts: x [R, H] in ``x``'s dtype, ids [R, K] int64
        local, weights [R, K] float32."""
        check_routing(x, topk_ids, topk_weights)
        mark = self.meter.start(x)
        mask = copy_mask(topk_ids, self.num_local_experts, self.world)
        send_counts, recv_counts = self._exchange_counts(mask.sum(0).long())
        plan = plan_routes(topk_ids, topk_weights, self.num_local_experts, mask, sum(send_counts))
        wire = WireFormat(x.shape[1], topk_ids.shape[1], x.dtype, self.payload_dtype)
        recv = self._exchange(wire.pack(x, plan), sum(recv_counts), recv_counts, send_counts)
        state = A2AState(plan.src_token, send_counts, recv_counts, x.shape[0])
        out = Dispatched(*wire.unpack(recv), state=state)
        self.meter.stop(mark, "dispatch", "a2a", sum(recv_counts), wire.row_bytes)
        return out

    def combine(self, y: Tensor, dispatched: Dispatched) -> Tensor:
        """``y`` [R, H]: this rank's weighted expert sum per received row -> [T, H] in ``y``'s
        dtype, every rank's part added (in float32) in the token order of ``dispatch``."""
        s: A2AState = dispatched.state
        if y.shape[0] != sum(s.recv_counts):
            raise ValueError(f"expected y with {sum(s.recv_counts)} rows, got {y.shape[0]}")
        mark = self.meter.start(y)
        back = self._exchange(y.contiguous(), sum(s.send_counts), s.send_counts, s.recv_counts)
        out = sum_back(back, s.src_token, s.num_tokens)
        self.meter.stop(mark, "combine", "a2a", y.shape[0], y.shape[1] * y.element_size())
        return out
