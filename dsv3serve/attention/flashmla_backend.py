"""MLA attention whose absorbed form (decode, speculative verify) runs FlashMLA's SM90 dense
decode kernels (``sgl-flash-mla`` 1.0.0, the "legacy" kernels), over a bf16 pool or an fp8
pool with one scale per layer.

- Absorbed form: ``flash_mla.flash_mla_with_kvcache(q, k_cache, block_table, cache_seqlens,
  512, sched_meta, use_legacy=True, ...)`` per layer, with
  ``q`` [B, s_q, H, 576] (``[q_latent | q_pe]``), ``k_cache`` the layer's pool buffer viewed
  [pages, 64, 1, 576], ``block_table`` [B, W] int32 and ``cache_seqlens`` [B] int32; output
  [B, s_q, H, 512] bf16. Several new tokens per sequence (verify) are causal, bottom-right
  aligned. The scheduler metadata (``get_mla_decoding_metadata``, a small kernel over
  ``cache_seqlens``) is built once per step in :meth:`plan`, not per layer. A batch whose
  sequences add different numbers of tokens runs one call per count
  (:func:`~dsv3serve.attention.flashmla_meta.query_groups`).
- ``q``: ``q_latent`` and ``q_pe`` packed into one contiguous [T, H, 576] tensor by one
  launch (:func:`~dsv3serve.kernels.flashmla_q.pack_q`); the kernel's output is returned as
  a view, never copied (one scatter per group where a batch runs several calls).
- FP8 (``kv_cache_dtype='fp8_e4m3'``): FlashMLA's dense FP8 kernel reads e4m3 KV and an e4m3
  ``q`` with one float32 descale each, so its pool keeps one scale per layer
  (``MLAKVPool(fp8_scales="layer")``: fixed when the pool is built, 1.0 by default,
  saturating writes; see the pool) and ``q`` has a fixed scale too (``q_scale``, 1.0 by
  default, as SGLang's FlashMLA FP8 path passes for DeepSeek-V3): the same launch that
  packs ``q`` stores ``e4m3(clamp(q / q_scale, +-448))``. Nothing is reduced over ``q``
  per call. Past ``448 * q_scale`` a value saturates (never NaN); e4m3 keeps 3 mantissa
  bits from ``2**-6 * q_scale`` up (relative error at most 2^-4), below that an absolute
  error of at most ``2**-10 * q_scale``.
- MHA form (prefill, extend): flashinfer's ragged prefill, the flashinfer backend's path
  (:class:`~dsv3serve.attention.triton_mla_extend.FlashInferExtendBackend`).
- CUDA graphs: with :class:`~dsv3serve.attention.base.CudaGraphLimits`, a uniform batch of up
  to ``max_batch_size`` sequences plans into fixed buffers per ``graph_slot``
  (:class:`~dsv3serve.attention.flashmla_meta.GraphTables`), so a graph captured after one
  ``plan()`` replays correctly after a later ``plan()`` of the same batch size.

Needs 64-token pages, latents of 512 + 64 and CUDA; ``flash_mla`` is imported when the
backend is built, never when this module is.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from dsv3serve.attention.base import (
    AttentionBackend,
    CudaGraphLimits,
    ExpandKV,
    MLADims,
    PooledAttentionBackend,
)
from dsv3serve.attention.flashmla_meta import GraphTables, QueryGroup, query_groups
from dsv3serve.attention.flashmla_ops import (
    DEFAULT_Q_SCALE,
    LATENT_DIM,
    PAGE_SIZE,
    FlashMLAHandle,
    check_flashmla,
    import_flash_mla,
)
from dsv3serve.forward_batch import ForwardBatch
from dsv3serve.kernels.flashmla_q import pack_q

if TYPE_CHECKING:
    from dsv3serve.kvcache.pool import MLAKVPool


@dataclass(frozen=True)
class Launch:
    """One kernel call of a planned step: a group's device arrays and scheduler metadata.

    ``rows`` [n * s_q] int64 (None: the whole batch in order), ``block_table`` [n, W] and
    ``seq_lens`` [n] int32; ``sched``: a ``FlashMLASchedMeta`` holding the split-KV schedule
    (``tile_scheduler_metadata`` [parts, 8] and ``num_splits`` [n + 1] int32), built with
    the plan and passed to every layer's call.
    """

    s_q: int
    rows: torch.Tensor | None
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    sched: FlashMLAHandle


class FlashMLAAttention(PooledAttentionBackend):
    """MLA over the paged latent cache with FlashMLA decode kernels: see the module doc."""

    supports_cuda_graphs = True
    serves_fp8_pool = True
    fp8_scales = "layer"

    def __init__(
        self,
        pool: MLAKVPool,
        dims: MLADims,
        *,
        cuda_graph: CudaGraphLimits | None = None,
        extend: AttentionBackend | None = None,
        q_scale: float = DEFAULT_Q_SCALE,
    ) -> None:
        """``extend``: the MHA-form backend (default: flashinfer's ragged prefill).
        ``q_scale``: the fixed scale of ``q`` over an fp8 pool (see the module doc)."""
        check_flashmla(pool, dims)
        if not q_scale > 0:
            raise ValueError(f"q_scale: expected a positive float, got {q_scale}")
        self._ops = import_flash_mla()
        self.pool, self.dims = pool, dims
        fp8 = pool.is_fp8
        self._q_dtype = torch.float8_e4m3fn if fp8 else torch.bfloat16
        self._q_inv_scale = 1.0 / q_scale
        self._descale_q = (
            torch.full((1,), q_scale, dtype=torch.float32, device=pool.device) if fp8 else None
        )
        self._graph = None
        if cuda_graph is not None:
            width = min(cuda_graph.block_table_width, pool.num_pages)
            self._graph = GraphTables(cuda_graph.max_batch_size, width, pool.device)
        self._extend = extend or _default_extend(pool, dims)
        self._batch: ForwardBatch | None = None
        self._launches: list[Launch] | None = None
        self._mha_planned = False
        self.graph_slot = "decode"  # CUDA-graph buffers this instance plans into
        self.index_mode = ""  # "page" once an absorbed plan ran (FlashMLA reads pages only)

    # ---- planning ------------------------------------------------------------------------
    def plan(self, batch: ForwardBatch) -> None:
        self._batch, self._launches, self._mha_planned = batch, None, False
        if batch.is_decode:
            self._launches = self._plan_absorbed(batch)
        else:
            self._extend.plan(batch)
            self._mha_planned = True

    def _plan_absorbed(self, batch: ForwardBatch) -> list[Launch]:
        graph = self._graph
        fixed = graph is not None and graph.fits(batch.batch_size)
        width = graph.width if fixed and graph is not None else 0
        groups = query_groups(batch, PAGE_SIZE, width)
        self.index_mode = "page"
        if fixed and len(groups) == 1:
            return [self._fixed_launch(groups[0])]
        return [self._launch(group) for group in groups]

    def _launch(self, group: QueryGroup) -> Launch:
        """A group's arrays in new device tensors (one pinned, non-blocking copy)."""
        arrays = [group.block_table.reshape(-1), group.seq_lens.astype(np.int32)]
        if group.rows is not None:
            arrays.append(group.rows.astype(np.int32))
        moved = _to_device(arrays, self.pool.device)
        table = moved[0].view(group.num_seqs, -1)
        rows = moved[2].long() if group.rows is not None else None
        sched = self._sched(*self._metadata(moved[1], group.s_q))
        return Launch(group.s_q, rows, table, moved[1], sched)

    def _fixed_launch(self, group: QueryGroup) -> Launch:
        """A whole-batch group in the slot's fixed buffers (CUDA graphs)."""
        assert self._graph is not None
        table, lens = self._graph.load(self.graph_slot, group)
        key = (self.graph_slot, group.num_seqs, group.s_q)
        metadata = self._graph.keep_metadata(key, self._metadata(lens, group.s_q))
        return Launch(group.s_q, None, table, lens, self._sched(*metadata))

    def _sched(self, tile_metadata: torch.Tensor, num_splits: torch.Tensor) -> FlashMLAHandle:
        """A ``FlashMLASchedMeta`` holding a planned schedule (the kernel then computes none)."""
        sched = self._ops.sched_meta()
        sched.tile_scheduler_metadata, sched.num_splits = tile_metadata, num_splits
        return sched

    def _metadata(self, seq_lens: torch.Tensor, s_q: int) -> tuple[torch.Tensor, torch.Tensor]:
        """FlashMLA's split-KV schedule for ``seq_lens`` (a kernel launch; once per step)."""
        md, splits = self._ops.decoding_metadata(
            seq_lens, s_q * self.dims.num_heads, 1, is_fp8_kvcache=self.pool.is_fp8, use_legacy=True
        )
        return md, splits

    # ---- per layer -----------------------------------------------------------------------
    def _need_batch(self) -> ForwardBatch:
        if self._batch is None:
            raise RuntimeError("plan(batch) must be called before forward")
        return self._batch

    def write_slots(self) -> torch.Tensor:
        return self._need_batch().out_slots

    def forward_absorbed(
        self, q_latent: torch.Tensor, q_pe: torch.Tensor, layer_id: int, scale: float
    ) -> torch.Tensor:
        batch = self._need_batch()
        if self._launches is None:  # a forced absorbed form on an extend batch
            self._launches = self._plan_absorbed(batch)
        q = pack_q(q_latent, q_pe, self._q_dtype, self._q_inv_scale)  # [T, H, 576]
        t, h = q.shape[:2]
        if len(self._launches) == 1 and self._launches[0].rows is None:
            return self._run(self._launches[0], q, layer_id, scale)
        out = q_latent.new_empty(t, h, LATENT_DIM)
        for launch in self._launches:
            assert launch.rows is not None
            out[launch.rows] = self._run(launch, q[launch.rows], layer_id, scale)
        return out

    @torch.compiler.disable  # an opaque kernel call, as the Triton kernels
    def _run(self, launch: Launch, q: torch.Tensor, layer_id: int, scale: float) -> torch.Tensor:
        """One FlashMLA call: ``q`` [n * s_q, H, 576] (packed) -> [n * s_q, H, 512] bf16."""
        n, h = launch.seq_lens.shape[0], q.shape[1]
        kv = self.pool.kv_buffer(layer_id).view(-1, PAGE_SIZE, 1, self.pool.kv_dim)
        fp8 = self.pool.is_fp8
        out, _lse = self._ops.with_kvcache(
            q.view(n, launch.s_q, h, q.shape[-1]),
            kv,
            launch.block_table,
            launch.seq_lens,
            LATENT_DIM,
            launch.sched,
            softmax_scale=scale,
            causal=launch.s_q > 1,
            is_fp8_kvcache=fp8,
            use_legacy=True,
            descale_q=self._descale_q,
            descale_k=self.pool.layer_scale(layer_id) if fp8 else None,
        )
        return out.reshape(n * launch.s_q, h, LATENT_DIM)  # a view of a contiguous output

    def forward_mha(
        self, q: torch.Tensor, layer_id: int, scale: float, expand_kv: ExpandKV
    ) -> torch.Tensor:
        batch = self._need_batch()
        if not self._mha_planned:  # a forced MHA form on a decode batch
            self._extend.plan(batch)
            self._mha_planned = True
        return self._extend.forward_mha(q, layer_id, scale, expand_kv)


def _to_device(arrays: list[np.ndarray], device: torch.device) -> list[torch.Tensor]:
    """int32 host arrays as device tensors through one (pinned) buffer, one copy."""
    flat = torch.from_numpy(np.concatenate(arrays).astype(np.int32, copy=False))
    if device.type == "cuda":
        flat = flat.pin_memory()
    return list(flat.to(device, non_blocking=True).split([len(a) for a in arrays]))


def _default_extend(pool: MLAKVPool, dims: MLADims) -> AttentionBackend:
    from dsv3serve.attention.triton_mla_extend import FlashInferExtendBackend

    return FlashInferExtendBackend(pool, dims)
