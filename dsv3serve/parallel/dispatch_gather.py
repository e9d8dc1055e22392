"""A dispatcher whose uniform-batch path CUDA graphs can capture: all-gather, reduce-scatter.

Under DP attention each rank holds its own tokens. The all-to-all dispatcher moves each
token only to the ranks owning its experts, but its split sizes are read on the host, so a
graph cannot hold it. When every rank runs the same number of rows (a graphed decode step:
:func:`~dsv3serve.parallel.uniform.uniform_batch`), this dispatcher instead gathers every
rank's rows, ids and weights to every rank (fixed shapes), each rank runs its own experts on
all of them, and one reduce-scatter sums each token's parts back onto its rank. That moves
``world`` times the rows of a top-k-limited all-to-all, which is what decode batches can
afford (SGLang's DP-attention MoE without DeepEP gathers the same way). Outside a uniform
batch (prefill, mixed and unequal steps) it hands every call to the wrapped dispatcher.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from dsv3serve.parallel.comm import Comm
from dsv3serve.parallel.dispatch_base import Dispatched, Dispatcher
from dsv3serve.parallel.dispatch_pack import check_routing
from dsv3serve.parallel.uniform import check_uniform, uniform_rows


def pack_rows(x: Tensor, ids: Tensor, weights: Tensor) -> Tensor:
    """Each token's hidden row, top-k ids (int64) and weights (float32) side by side as raw
    bytes [T, H * x.element_size() + 12 * K] (uint8): one all-gather moves all three."""
    return torch.cat([p.contiguous().view(torch.uint8) for p in (x, ids, weights)], 1)


def unpack_rows(buf: Tensor, x: Tensor, k: int) -> tuple[Tensor, Tensor, Tensor]:
    """Inverse of :func:`pack_rows` over gathered rows [N, bytes]: hidden [N, H] of ``x``'s
    dtype, ids [N, k] int64, weights [N, k] float32."""
    hidden = x.shape[1] * x.element_size()
    cuts = (0, hidden, hidden + 8 * k, hidden + 12 * k)
    dtypes = (x.dtype, torch.int64, torch.float32)
    xs, ids, weights = (
        buf[:, lo:hi].contiguous().view(dtype)
        for lo, hi, dtype in zip(cuts[:-1], cuts[1:], dtypes, strict=True)
    )
    return xs, ids, weights


@dataclass(frozen=True)
class _Gathered:
    """A uniform dispatch's state: the rows each rank sent."""

    rows: int


class UniformGatherDispatcher(Dispatcher):
    """``inner`` for steps whose ranks differ; all-gather / reduce-scatter over ``comm`` (the
    expert-parallel group, global expert ``e`` on rank ``e // num_local_experts``) inside a
    uniform batch. No host sync on that path, so ``graph_safe``."""

    graph_safe: ClassVar[bool] = True

    def __init__(self, inner: Dispatcher, comm: Comm) -> None:
        self.inner, self.comm = inner, comm
        self.num_local_experts = inner.num_local_experts
        self.meter = inner.meter  # eager steps are the inner's; graphed ones are not metered

    def dispatch(self, x: Tensor, topk_ids: Tensor, topk_weights: Tensor) -> Dispatched:
        if uniform_rows() is None:
            return self.inner.dispatch(x, topk_ids, topk_weights)
        check_routing(x, topk_ids, topk_weights)
        rows = check_uniform(x.shape[0], "dispatch")
        packed = pack_rows(x, topk_ids.long(), topk_weights.float())
        xs, ids, weights = unpack_rows(self.comm.all_gather(packed, 0), x, topk_ids.shape[1])
        local = ids - self.comm.rank * self.num_local_experts
        held = (ids >= 0) & (local >= 0) & (local < self.num_local_experts)
        return Dispatched(
            xs, torch.where(held, local, -1), torch.where(held, weights, 0.0), _Gathered(rows)
        )

    def combine(self, y: Tensor, dispatched: Dispatched) -> Tensor:
        if not isinstance(dispatched.state, _Gathered):
            return self.inner.combine(y, dispatched)
        expected = dispatched.state.rows * self.comm.world_size
        if y.shape[0] != expected:
            raise ValueError(f"expected y with {expected} rows (every rank's), got {y.shape[0]}")
        return self.comm.reduce_scatter_rows(y)
