"""Expert-parallel dispatch / combine over DeepEP's ``deep_ep.Buffer`` (normal and low-latency).

Written against DeepEP's Python API (``deep_ep.Buffer``: ``get_dispatch_layout``,
``dispatch``, ``combine``, ``low_latency_dispatch``, ``low_latency_combine``, as in DeepEP
v1.2 and the ``buffers/legacy.py`` of v2). The ``deep_ep`` module is passed in, so CPU tests
run the same glue over ``tests/support/fake_deep_ep.py``; :mod:`dsv3serve.parallel.deepep_check`
imports the real one and checks it before this class is built.

* **normal** (prefill / extend): ``get_dispatch_layout`` then ``dispatch`` sends each token
  once per rank holding one of its experts; rows arrive flat with *local* top-k ids (``-1``
  elsewhere) -- the :class:`Dispatched` contract. ``combine`` sums the rows back unweighted
  (the caller already applied the weights). With ``payload_dtype`` e4m3 the rows travel as
  (e4m3, float32 scale per 128 channels) and are dequantised on arrival.
* **low_latency** (decode): ``low_latency_dispatch`` leaves [E_local, max_tokens * W, H]
  per expert with valid counts (:class:`MaskedDispatched`), fixed shapes, no host sync;
  ``low_latency_combine`` applies the top-k weights. FP8 (1x128 scales) when
  ``payload_dtype`` is e4m3: the masked MoE gets the e4m3 rows and their scales as they
  arrived (no dequantisation of the padded receive buffer).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from dsv3serve.kernels.fp8_ref import BLOCK, FP8_DTYPE, quant_per_token_group
from dsv3serve.parallel.config import DeepEPMode
from dsv3serve.parallel.deepep_sizes import (
    NORMAL_BUFFER_FLOOR,
    low_latency_rdma_bytes,
    normal_nvl_bytes,
)
from dsv3serve.parallel.dispatch_base import (
    Dispatched,
    Dispatcher,
    MaskedDispatched,
    MaskedDispatcher,
    dequant_rows,
)
from dsv3serve.parallel.dispatch_meter import Counted, DispatchMeter

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DeepEPShape:
    """What the buffers are sized for: ``hidden`` and, for low-latency,
    ``max_tokens_per_rank`` (every rank the same; DeepEP sizes its RDMA buffer from it)."""

    num_experts: int
    hidden: int
    max_tokens_per_rank: int = 128


@dataclass(frozen=True)
class _NormalState:
    handle: tuple
    dtype: torch.dtype


@dataclass(frozen=True)
class _MaskedState:
    handle: tuple
    topk_ids: Tensor
    topk_weights: Tensor
    metered_rows: Counted | None  # the dispatch's recorded row count (None: not metered)


def _check_bf16(x: Tensor) -> None:
    if x.dtype != torch.bfloat16:
        raise ValueError(f"DeepEP dispatch expects bfloat16 hidden states, got {x.dtype}")


class DeepEPDispatcher(Dispatcher, MaskedDispatcher):
    """Both DeepEP modes behind the dispatcher interfaces; ``mode`` picks which the
    engine's batches take (:meth:`use_masked`): ``normal`` always flat, ``low_latency``
    always masked, ``auto`` masked for decode and flat for prefill (SGLang's rule).

    ``deep_ep`` is the imported module (real or fake); ``group`` the expert-parallel
    process group (None: the world). One ``deep_ep.Buffer`` serves both modes (NVLink bytes
    for normal, RDMA bytes for low-latency); under ``auto`` it is cleaned with
    ``clean_low_latency_buffer`` before the first low-latency call after a normal one, as
    DeepEP requires.

    ``meter``: per call, the rows on this rank's expert side (received by dispatch, sent
    back by combine) times the row as DeepEP sends it (bf16 hidden, or e4m3 hidden plus one
    float32 scale per 128 channels; DeepEP's routing metadata not counted), mode label
    ``normal`` or ``low_latency``. Normal mode counts the received shape (a host int after
    DeepEP's own sync); low-latency mode the per-expert counts, summed on the device and
    read later (no host sync).
    """

    meter: DispatchMeter

    def __init__(
        self,
        deep_ep: ModuleType,
        shape: DeepEPShape,
        mode: DeepEPMode,
        group: dist.ProcessGroup | None = None,
        payload_dtype: torch.dtype | None = None,
        metered: bool = True,
    ) -> None:
        self.ep, self.shape, self.mode, self.group = deep_ep, shape, mode, group
        self.world, self.rank = dist.get_world_size(group), dist.get_rank(group)
        if shape.num_experts % self.world:
            raise ValueError(
                f"num_experts {shape.num_experts} must divide over the {self.world} ranks"
            )
        if payload_dtype not in (None, FP8_DTYPE):
            raise ValueError(f"payload_dtype: expected None or {FP8_DTYPE}, got {payload_dtype}")
        self.num_local_experts = shape.num_experts // self.world
        self.max_tokens_per_rank = shape.max_tokens_per_rank
        self.fp8 = payload_dtype == FP8_DTYPE
        # v2 exports the id dtype it was built with; v1.2 takes int64
        self.idx_dtype: torch.dtype = getattr(deep_ep, "topk_idx_t", torch.int64)
        self.meter = DispatchMeter(self.rank, enabled=metered)
        self.buffer = self._make_buffer()
        self._ll_dirty = False  # a normal-mode call used the buffer since the last clean
        self._check_qp_depth()

    @property
    def _group(self) -> dist.ProcessGroup:
        group = self.group if self.group is not None else dist.group.WORLD
        if group is None:
            raise RuntimeError("expected an initialised default process group, found none")
        return group

    def _nvl_bytes(self) -> int:
        hidden_bytes = self.shape.hidden * 2  # bf16 rows
        cfgs = (self.ep.Buffer.get_dispatch_config, self.ep.Buffer.get_combine_config)
        hints = [c(self.world).get_nvl_buffer_size_hint(hidden_bytes, self.world) for c in cfgs]
        return max(NORMAL_BUFFER_FLOOR, *hints)

    def _rdma_bytes(self) -> int:
        s = self.shape
        return self.ep.Buffer.get_low_latency_rdma_size_hint(
            s.max_tokens_per_rank, s.hidden, self.world, s.num_experts
        )

    def _make_buffer(self) -> Any:
        """One buffer for the modes used, as SGLang and DeepEP's own tests make it."""
        low_latency = self.mode != "normal"
        nvl = self._nvl_bytes() if self.mode != "low_latency" else 0
        rdma = self._rdma_bytes() if low_latency else 0
        self._log_if_unplanned(nvl, rdma)
        return self.ep.Buffer(
            self._group,
            num_nvl_bytes=nvl,
            num_rdma_bytes=rdma,
            low_latency_mode=low_latency,
            num_qps_per_rank=self.num_local_experts if low_latency else 1,
            # released by close() on every rank at once: the destructor's release is a
            # barrier with the other ranks, which hangs in whichever rank exits first
            explicitly_destroy=True,
        )

    def _log_if_unplanned(self, nvl: int, rdma: int) -> None:
        """Warn when DeepEP's own size hints differ from the planner's formulas
        (:mod:`dsv3serve.parallel.deepep_sizes`): the plan then misses the difference."""
        s = self.shape
        planned_nvl = normal_nvl_bytes(s.hidden, self.world) if nvl else 0
        planned_rdma = low_latency_rdma_bytes(s.max_tokens_per_rank, s.hidden, s.num_experts)
        planned_rdma = planned_rdma if rdma else 0
        if (nvl, rdma) != (planned_nvl, planned_rdma):
            logger.warning(
                "DeepEP buffers differ from the plan: NVLink %d vs %d bytes, RDMA %d vs %d "
                "(deep_ep %s)", nvl, planned_nvl, rdma, planned_rdma,
                getattr(self.ep, "__version__", "?"),
            )  # fmt: skip

    def close(self) -> None:
        """Release the DeepEP buffer (collective: a barrier with every rank of the group)."""
        if self.buffer is not None:
            self.buffer.destroy()
            self.buffer = None

    def _check_qp_depth(self) -> None:
        """DeepEP's low-latency calls assert ``nvshmem_qp_depth >= 2 * (max_tokens + 1)``;
        refuse here, at start, rather than on the first decode step."""
        depth = getattr(self.buffer, "nvshmem_qp_depth", None)
        need = 2 * (self.max_tokens_per_rank + 1)
        if self.mode != "normal" and depth is not None and depth < need:
            raise ValueError(
                f"DeepEP low-latency mode with max_tokens_per_rank {self.max_tokens_per_rank} "
                f"needs NVSHMEM_QP_DEPTH >= {need}, found {depth} (set the variable, or lower "
                "the engine's per-rank decode bound, max_running_requests)"
            )

    @property
    def graph_safe(self) -> bool:  # type: ignore[override]
        """True exactly in ``low_latency`` mode, where every batch takes the masked pair:
        ``dispatch_masked`` / ``combine_masked`` have shapes fixed by ``max_tokens_per_rank``
        and the group size (not by the routing), read no device value on the host, leave
        DeepEP's buffer as allocated once at start, and take padding rows through
        ``num_tokens`` on the device (:class:`MaskedDispatcher`). Also in ``auto``, whose
        graphs are decode steps (the masked pair): the clean that a normal-mode step makes
        due is decided on the host, so the runner calls :meth:`prepare_graph` before each
        capture and replay. Not ``normal`` (DeepEP waits for the received count on the
        host)."""
        return self.mode != "normal"

    def prepare_graph(self) -> None:
        """Before a captured masked pair runs (capture or replay): clean the low-latency
        buffer now if a normal-mode call used it since the last clean."""
        self._clean_if_dirty()

    def _row_bytes(self) -> int:
        """Bytes of one hidden row as DeepEP sends it (bf16, or e4m3 + 1x128 scales)."""
        h = self.shape.hidden
        return h + 4 * -(-h // BLOCK) if self.fp8 else 2 * h

    def use_masked(self, decode: bool) -> bool:
        """``low_latency``: always; ``auto``: decode batches; ``normal``: never."""
        return self.mode == "low_latency" or (self.mode == "auto" and decode)

    # -- normal mode -------------------------------------------------------------------

    def _send_rows(self, x: Tensor) -> Tensor | tuple[Tensor, Tensor]:
        return quant_per_token_group(x) if self.fp8 else x

    def dispatch(self, x: Tensor, topk_ids: Tensor, topk_weights: Tensor) -> Dispatched:
        """Normal-mode dispatch: ``x`` [T, H] bf16 -> flat rows with local ids (one host
        sync inside DeepEP for the received count)."""
        if self.mode == "low_latency":
            raise RuntimeError("deepep_mode 'low_latency' sends every batch masked")
        _check_bf16(x)
        mark = self.meter.start(x)
        ids = topk_ids.to(self.idx_dtype)
        per_rank, per_rdma_rank, per_expert, in_rank, _ = self.buffer.get_dispatch_layout(
            ids, self.shape.num_experts
        )
        self._ll_dirty = self.mode == "auto"
        recv, recv_ids, recv_w, _, handle, _ = self.buffer.dispatch(
            self._send_rows(x),
            num_tokens_per_rank=per_rank,
            num_tokens_per_rdma_rank=per_rdma_rank,
            is_token_in_rank=in_rank,
            num_tokens_per_expert=per_expert,
            topk_idx=ids,
            topk_weights=topk_weights.float(),
        )
        if isinstance(recv, tuple):  # fp8 payload: e4m3 rows and their scales
            q, scales = recv
            rows = dequant_rows(q, scales, x.dtype)
        else:
            rows = recv
        recv_ids = recv_ids.long()
        recv_w = torch.where(recv_ids >= 0, recv_w.float(), 0.0)
        self.meter.stop(mark, "dispatch", "normal", rows.shape[0], self._row_bytes())
        return Dispatched(rows, recv_ids, recv_w, state=_NormalState(handle, x.dtype))

    def combine(self, y: Tensor, dispatched: Dispatched) -> Tensor:
        """``y`` [R, H] weighted expert sums -> [T, H], summed over ranks by DeepEP."""
        s: _NormalState = dispatched.state
        mark = self.meter.start(y)
        combined, _, _ = self.buffer.combine(y.to(s.dtype).contiguous(), s.handle)
        self.meter.stop(mark, "combine", "normal", y.shape[0], 2 * self.shape.hidden)
        return combined

    # -- low-latency mode --------------------------------------------------------------

    def dispatch_masked(
        self, x: Tensor, topk_ids: Tensor, topk_weights: Tensor, num_tokens: Tensor | None = None
    ) -> MaskedDispatched:
        """Low-latency dispatch: ``x`` [T, H] bf16, ``T <= max_tokens_per_rank`` ->
        [E_local, max_tokens_per_rank * W, H] rows (bf16, or e4m3 with ``x_scale`` under FP8
        dispatch) with per-expert valid counts. Rows at or past ``num_tokens`` (a device
        scalar) are padding: routed nowhere."""
        if self.mode == "normal":
            raise RuntimeError("deepep_mode 'normal' has no low-latency buffer")
        _check_bf16(x)
        if x.shape[0] > self.max_tokens_per_rank:
            raise ValueError(
                f"low-latency dispatch of {x.shape[0]} tokens: expected at most "
                f"max_tokens_per_rank {self.max_tokens_per_rank}"
            )
        mark = self.meter.start(x)
        ids = _route_padding_nowhere(topk_ids.to(self.idx_dtype), num_tokens)
        self._clean_if_dirty()
        recv, counts, handle, _, _ = self.buffer.low_latency_dispatch(
            x, ids, self.max_tokens_per_rank, self.shape.num_experts, use_fp8=self.fp8
        )
        rows, scales = recv if self.fp8 else (recv, None)
        metered = self.meter.stop(mark, "dispatch", "low_latency", counts, self._row_bytes())
        state = _MaskedState(handle, ids, topk_weights.float(), metered)
        return MaskedDispatched(rows, counts, state=state, x_scale=scales)

    def _clean_if_dirty(self) -> None:
        """DeepEP: after normal-mode kernels, clean before any low-latency kernel."""
        if self._ll_dirty:
            s = self.shape
            self.buffer.clean_low_latency_buffer(s.max_tokens_per_rank, s.hidden, s.num_experts)
            self._ll_dirty = False

    def combine_masked(self, y: Tensor, dispatched: MaskedDispatched) -> Tensor:
        """``y`` [E_local, M, H] unweighted expert outputs -> [T, H] bf16 weighted sums."""
        s: _MaskedState = dispatched.state
        mark = self.meter.start(y)
        combined, _, _ = self.buffer.low_latency_combine(
            y.to(torch.bfloat16).contiguous(), s.topk_ids, s.topk_weights, s.handle
        )
        rows = s.metered_rows or dispatched.counts  # the dispatch's count, summed and copied once
        self.meter.stop(mark, "combine", "low_latency", rows, 2 * self.shape.hidden)
        return combined


def _route_padding_nowhere(ids: Tensor, num_tokens: Tensor | None) -> Tensor:
    """``ids`` [T, K] with rows at or past ``num_tokens`` set to ``-1`` (on the device)."""
    if num_tokens is None:
        return ids
    real = torch.arange(ids.shape[0], device=ids.device) < num_tokens.to(ids.device)
    return torch.where(real[:, None], ids, -1)
