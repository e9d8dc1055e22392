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

import torch
from torch import Tensor

from dsv3serve.kernels.fp8_ref import BLOCK
from dsv3serve.parallel.dispatch_meter import DispatchMeter


@dataclass
class Dispatched:
    """What arrived on this rank: ``x`` [R, H], ``topk_ids`` [R, K] int64 local expert ids
    (``-1``: not on this rank), ``topk_weights`` [R, K] float32 (0 where the id is ``-1``),
    and the backend's state for :meth:`Dispatcher.combine`."""

    x: Tensor
    topk_ids: Tensor
    topk_weights: Tensor
    state: Any = None


def dequant_rows(q: Tensor, scales: Tensor, dtype: torch.dtype) -> Tensor:
    """e4m3 rows [..., H] with float32 scales [..., ceil(H/128)] (any strides) -> ``dtype``."""
    h = q.shape[-1]
    s = scales.float().repeat_interleave(BLOCK, dim=-1)[..., :h]
    return (q.float() * s).to(dtype)


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

    step_is_decode: bool = False
    """Whether the group's current step is a decode step on every rank. The DP group sets it
    before each forward from the step header, so all ranks agree even where a rank has no
    tokens; a masked dispatcher (DeepEP ``auto``) picks its mode by it."""

    step_max_tokens: int = 0
    """The most tokens any rank of the group forwards in the current step (0: not known).
    Set with :attr:`step_is_decode`; a masked dispatcher sends a batch over its
    ``max_tokens_per_rank`` in this many tokens' worth of rounds, the same on every rank."""

    def prepare_graph(self) -> None:
        """Host-side work a captured dispatch / combine needs before it is captured or
        replayed (none by default)."""
        return

    def close(self) -> None:
        """Release what the dispatcher holds (nothing by default). Collective where the
        backend's release is (DeepEP's buffer): every rank of the group calls it once, at
        the same point, after its last dispatch; the group's STOP is that point."""
        return

    meter: DispatchMeter | None = None
    """This rank's dispatch / combine latency and bytes (None: the backend moves nothing
    between ranks, or only pretends to; a meter with ``enabled`` False: metering is off)."""

    @abstractmethod
    def dispatch(self, x: Tensor, topk_ids: Tensor, topk_weights: Tensor) -> Dispatched:
        """``x`` [T, H], ``topk_ids`` [T, K] global expert ids, ``topk_weights`` [T, K]."""

    @abstractmethod
    def combine(self, y: Tensor, dispatched: Dispatched) -> Tensor:
        """``y`` [R, H]: this rank's weighted expert sum per received row -> [T, H] summed
        over ranks, in the token order of the matching ``dispatch``."""


@dataclass
class MaskedDispatched:
    """What a low-latency dispatch left on this rank, grouped per local expert with padding:
    ``x`` [E_local, M, H] (``M = max_tokens_per_rank * ep_size``; only rows ``< counts[e]`` of
    expert ``e`` are valid, the rest is stale data that must never be read), ``counts``
    [E_local] int32, and the backend's state for :meth:`MaskedDispatcher.combine_masked`.
    Shapes do not depend on the routing, so the pair can be captured into a CUDA graph.
    With FP8 dispatch ``x`` is e4m3 and ``x_scale`` [E_local, M, H/128] float32 holds one
    scale per (row, 128 channels), in the backend's strides; None for 16-bit rows."""

    x: Tensor
    counts: Tensor
    state: Any = None
    x_scale: Tensor | None = None

    def rows(self, dtype: torch.dtype = torch.bfloat16) -> Tensor:
        """``x`` in ``dtype``: e4m3 rows dequantised with their scales (a whole-buffer
        pass, for checks and identity experts; the masked MoE reads e4m3 as it is)."""
        if self.x_scale is None:
            return self.x.to(dtype)
        return dequant_rows(self.x, self.x_scale, dtype)


class MaskedDispatcher(ABC):
    """A dispatcher with a fixed-shape, per-expert layout (DeepEP's low-latency mode).

    The caller runs local expert ``e`` on ``x[e, :counts[e]]`` *unweighted*; combine applies
    the top-k weights while summing each token's parts on its own rank.

    Padding (the CUDA-graph contract): a graph replays one batch size ``T``, so the caller
    keeps static ``[T, H]`` / ``[T, K]`` input buffers, writes the step's real tokens into
    their first rows and passes how many there are as ``num_tokens`` (a device scalar the
    graph reads at replay). Rows at or past it are routed nowhere (their ids become ``-1``
    on the device): they are never sent, take no room in any expert's slab, whatever they
    hold (NaN included) reaches no result, and combine returns zeros for them.
    """

    max_tokens_per_rank: int
    """Most tokens any rank may send in one masked dispatch (same on every rank)."""

    step_max_tokens: int = 0
    """As :attr:`Dispatcher.step_max_tokens`: the most tokens any rank of the group forwards
    in the current step (0: not known); set by the engine, read by the masked MoE."""

    @abstractmethod
    def dispatch_masked(
        self, x: Tensor, topk_ids: Tensor, topk_weights: Tensor, num_tokens: Tensor | None = None
    ) -> MaskedDispatched:
        """``x`` [T, H] with ``T <= max_tokens_per_rank``, ``topk_ids`` [T, K] global ids;
        ``num_tokens`` (0-dim integer tensor on ``x``'s device, None: ``T``): rows at or past
        it are padding, routed nowhere."""

    @abstractmethod
    def combine_masked(self, y: Tensor, dispatched: MaskedDispatched) -> Tensor:
        """``y`` [E_local, M, H]: each valid row's expert output -> [T, H], the top-k
        weighted sum over ranks, in the token order of the matching ``dispatch_masked``."""

    @abstractmethod
    def use_masked(self, decode: bool) -> bool:
        """Whether a batch of this phase goes through the masked pair (else the flat one)."""
