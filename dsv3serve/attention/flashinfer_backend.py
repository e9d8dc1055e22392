"""MLA attention on flashinfer (Hopper: its fa3 kernels), over the pool's paged latent cache.

- Absorbed form (decode, speculative verify): ``BatchMLAPagedAttentionWrapper`` reads the
  cache in place. Each layer's ``[num_pages, page_size, 576]`` buffer is passed as two
  strided views, ``[..., :512]`` (c_kv) and ``[..., 512:]`` (k_pe); the kernel takes
  page and row strides. With several new tokens per sequence (speculative verify) the
  mask is causal, bottom-right aligned: each token sees the cache up to itself.
- Pages: when every sequence's slots fill its pages in order (what the engine's page
  tables give), the kernel gets page ids; otherwise it falls back, with one warning, to
  token-granular indices (``page_size=1``: each slot is a page), which are always valid.
- MHA form (prefill, extend): :class:`~dsv3serve.attention.flashinfer_mha.FlashInferExtend`.
- ``plan()`` plans the form ``batch.is_decode`` implies (the model's ``attn_impl="auto"``
  rule); a forced form (``attn_impl`` "mha" / "absorb") is planned at its first call.
- CUDA graphs: with :class:`CudaGraphLimits`, batches of up to ``max_batch_size``
  sequences use one wrapper per (``graph_slot``, batch size) over preallocated index
  buffers, one set per slot (flashinfer's ``use_cuda_graph=True`` mode), so a graph
  captured after ``plan()`` replays correctly after later ``plan()`` calls of the same
  batch size. Layouts that must stay planned together (the chained draft steps of one
  graph, verify beside decode, the speculative draft extend: slot ``"extend"``) plan on
  shallow copies with their own ``graph_slot``
  (:func:`dsv3serve.engine.graph_capture.fork_attention`).

Not supported: an fp8 KV cache (see :func:`check_pool`); ``create_attention_backend``
serves one with :class:`~dsv3serve.attention.triton_mla.TritonMLAAttention`.
"""

from __future__ import annotations

import logging
import math
from types import ModuleType
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from dsv3serve.attention.base import (
    CudaGraphLimits,
    ExpandKV,
    MLADims,
    PooledAttentionBackend,
)
from dsv3serve.attention.flashinfer_graph_plan import GraphIndexBuffers, can_replan, replan
from dsv3serve.attention.flashinfer_meta import (
    KVIndex,
    PlanStage,
    batch_kv_index,
    int32_host,
    seq_lens_list,
)
from dsv3serve.attention.flashinfer_mha import FlashInferExtend
from dsv3serve.forward_batch import ForwardBatch

if TYPE_CHECKING:
    from dsv3serve.kvcache.pool import MLAKVPool

logger = logging.getLogger(__name__)

FLASHINFER_VERSION = "0.6.18.post1"
WORKSPACE_BYTES = 128 * 1024 * 1024  # flashinfer's recommended float workspace
DEFAULT_PREFIX_CHUNK_TOKENS = 8192


def import_flashinfer() -> ModuleType:
    """``import flashinfer``, or ImportError saying what to install."""
    try:
        import flashinfer
    except ImportError as err:
        raise ImportError(
            f"attention backend 'flashinfer' needs flashinfer-python=={FLASHINFER_VERSION} "
            f"and apache-tvm-ffi (pip install 'dsv3serve[gpu]'): {err}"
        ) from err
    version = getattr(flashinfer, "__version__", "?")
    if version != FLASHINFER_VERSION:
        logger.warning(
            "flashinfer %s found; this backend is tested with %s", version, FLASHINFER_VERSION
        )
    return flashinfer


def check_pool(pool: MLAKVPool, dims: MLADims) -> None:
    """Raise unless flashinfer can read ``pool`` as it is laid out."""
    if pool.is_fp8:
        raise NotImplementedError(
            "attention backend 'flashinfer' with an fp8 KV cache: the pool stores one "
            "float32 scale per token for all 576 values, while flashinfer 0.6.18's fp8 MLA "
            "takes c_kv scales per token per 128 channels and a single per-tensor k_pe "
            "scale; create_attention_backend('flashinfer', ...) serves an fp8 pool with "
            "TritonMLAAttention"
        )
    if pool.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"flashinfer needs a bf16 or fp16 KV cache, got {pool.dtype}")
    if pool.kv_dim != dims.kv_cache_dim:
        raise ValueError(
            f"KV pool rows are {pool.kv_dim} wide, expected kv_lora_rank + qk_rope_head_dim"
            f" = {dims.kv_cache_dim}"
        )


class _MLAWrappers:
    """The eager MLA wrapper, plus CUDA-graph wrappers keyed by (slot, batch size).

    A slot is a layout that must stay planned while others are planned (decode, verify,
    each chained draft step); its wrappers share one set of index buffers.
    """

    def __init__(
        self, fi: ModuleType, workspace: torch.Tensor, graph: CudaGraphLimits | None
    ) -> None:
        self._fi, self._workspace, self._graph = fi, workspace, graph
        self._eager = fi.BatchMLAPagedAttentionWrapper(workspace, backend="auto")
        self._by_key: dict[tuple[str, int], Any] = {}
        self._buffers: dict[str, GraphIndexBuffers] = {}

    def get(self, batch_size: int, num_indices: int, slot: str = "decode") -> Any:
        """The wrapper for a batch; a graph wrapper of ``slot`` when it fits the limits."""
        graph = self._graph
        if graph is None or batch_size > graph.max_batch_size:
            return self._eager
        if num_indices > graph.max_kv_indices:
            raise ValueError(
                f"batch of {batch_size} needs {num_indices} KV indices, over the CUDA-graph "
                f"buffer of {graph.max_kv_indices} (CudaGraphLimits.max_kv_indices)"
            )
        if (slot, batch_size) not in self._by_key:
            self._by_key[slot, batch_size] = self._graph_wrapper(slot, batch_size)
        return self._by_key[slot, batch_size]

    def buffers(self, slot: str) -> GraphIndexBuffers:
        """The index buffers the graph wrappers of ``slot`` plan into."""
        assert self._graph is not None
        if slot not in self._buffers:
            limits, device = self._graph, self._workspace.device
            self._buffers[slot] = GraphIndexBuffers(
                limits.max_batch_size, limits.max_kv_indices, device
            )
        return self._buffers[slot]

    def is_graph(self, batch_size: int) -> bool:
        """Whether a batch of ``batch_size`` sequences plans a CUDA-graph wrapper."""
        return self._graph is not None and batch_size <= self._graph.max_batch_size

    def _graph_wrapper(self, slot: str, batch_size: int) -> Any:
        assert self._graph is not None
        buf = self.buffers(slot)
        return self._fi.BatchMLAPagedAttentionWrapper(
            self._workspace,
            use_cuda_graph=True,
            qo_indptr=buf.qo[: batch_size + 1],
            kv_indptr=buf.kv_indptr[: batch_size + 1],
            kv_indices=buf.kv_indices,
            kv_len_arr=buf.kv_lens[:batch_size],
            backend="auto",
        )


class FlashInferMLAAttention(PooledAttentionBackend):
    """MLA over the paged latent cache with flashinfer kernels (bf16/fp16 cache)."""

    supports_cuda_graphs = True
    serves_fp8_pool = False

    def __init__(
        self,
        pool: MLAKVPool,
        dims: MLADims,
        *,
        paged: bool = True,
        max_prefix_chunk_tokens: int = DEFAULT_PREFIX_CHUNK_TOKENS,
        cuda_graph: CudaGraphLimits | None = None,
        workspace_bytes: int = WORKSPACE_BYTES,
    ) -> None:
        """``paged=False`` always uses token-granular indices (for comparison)."""
        check_pool(pool, dims)
        fi = import_flashinfer()
        self.pool, self.dims, self.paged = pool, dims, paged
        workspace = torch.empty(workspace_bytes, dtype=torch.uint8, device=pool.device)
        self._mla = _MLAWrappers(fi, workspace, cuda_graph)
        self._extend = FlashInferExtend(fi, workspace, dims, pool.dtype, max_prefix_chunk_tokens)
        self._views = {size: self._latent_views(size) for size in {1, pool.page_size}}
        self._batch: ForwardBatch | None = None
        self._mla_run: tuple[Any, list[tuple[torch.Tensor, torch.Tensor]]] | None = None
        self._mha_planned = False
        self._planned: torch.Event | None = None
        self._planned_owner = 0  # id() of the instance that made ``_planned``
        self._stage: PlanStage | None = None
        self._warned_unaligned = False
        self.graph_slot = "decode"  # CUDA-graph wrappers this instance plans into
        self.index_mode = ""  # "page" or "token": how the last absorbed plan indexed KV
        self.replans = 0  # absorbed plans that reran only flashinfer's scheduler

    def _latent_views(self, page_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer, (c_kv [pages, page_size, 512], k_pe [pages, page_size, 64]) views."""
        rank, views = self.dims.kv_lora_rank, []
        for layer in range(self.pool.num_layers):
            buf = self.pool.kv_buffer(layer).view(-1, page_size, self.pool.kv_dim)
            views.append((buf[..., :rank], buf[..., rank:]))
        return views

    @property
    def prefix_chunks(self) -> int:
        """How many chunks the last extend plan split the cached prefixes into."""
        return self._extend.num_chunks

    # ---- planning ------------------------------------------------------------------------
    def plan(self, batch: ForwardBatch) -> None:
        self._wait_previous_plan()
        self._batch, self._mla_run, self._mha_planned = batch, None, False
        if batch.is_decode:
            self._plan_absorbed(batch)
        else:
            self._plan_mha(batch)

    def _wait_previous_plan(self) -> None:
        """flashinfer stages plan data in one pinned buffer per wrapper and copies it to
        the device asynchronously; replanning before that copy ran would corrupt the
        previous step. A no-op wait in the engine, which syncs on sampling every step."""
        if self._planned is not None:
            self._planned.synchronize()

    def _mark_planned(self) -> None:
        """Record the plan copy's event (``torch.Event``: see ``StaticInputs._mark_copied``)."""
        if self.pool.device.type != "cuda":
            return
        if self._planned is None or self._planned_owner != id(self):  # forks own theirs
            self._planned, self._planned_owner = torch.Event(device=self.pool.device), id(self)
        self._planned.record()

    def _plan_stage(self) -> PlanStage:
        """This instance's reused host buffer for plan arrays (not a fork's)."""
        stage = self._stage
        if stage is None or stage.owner != id(self):
            stage = self._stage = PlanStage(id(self), pin=self.pool.device.type == "cuda")
        return stage

    def _kv_index(self, batch: ForwardBatch) -> KVIndex:
        index, fallback = batch_kv_index(batch, self.pool.page_size, self.paged)
        if fallback and not self._warned_unaligned:
            logger.warning("flashinfer: %s; using token-granular KV indices", fallback)
            self._warned_unaligned = True
        return index

    def _plan_args(self, batch: ForwardBatch, index: KVIndex) -> list[torch.Tensor]:
        """qo_indptr, kv_indptr, kv_indices, kv_lens: host arrays in one (pinned) buffer;
        device indices (token fallback) are passed as they are."""
        host = [int32_host(batch.qo_indptr), index.indptr, index.lens]
        on_host = index.indices.device.type == "cpu"
        if on_host:
            host.append(index.indices)
        staged = self._plan_stage().stage(host)
        qo, indptr, lens = staged[:3]
        return [qo, indptr, staged[3] if on_host else index.indices, lens]

    def _plan_absorbed(self, batch: ForwardBatch) -> None:
        index, d, dtype = self._kv_index(batch), self.dims, self.pool.dtype
        num_indices = int(index.indices.shape[0])
        wrapper = self._mla.get(batch.batch_size, num_indices, self.graph_slot)
        causal = max(seq_lens_list(batch.qo_indptr)) > 1  # bottom-right, for verify
        if self._replan(batch, index, wrapper, causal):
            self.replans += 1
        else:
            wrapper.plan(
                *self._plan_args(batch, index),
                d.num_heads,
                d.kv_lora_rank,
                d.qk_rope_head_dim,
                index.page_size,
                causal,
                d.softmax_scale,
                dtype,
                dtype,
            )
        self._mla_run = (wrapper, self._views[index.page_size])
        self.index_mode = "token" if index.page_size == 1 else "page"
        self._mark_planned()

    def _replan(self, batch: ForwardBatch, index: KVIndex, wrapper: Any, causal: bool) -> bool:
        """A graph wrapper planned before for this kind of problem: one copy of the index
        arrays and the scheduler alone (:mod:`~dsv3serve.attention.flashinfer_graph_plan`).
        False where the full ``plan`` must run."""
        d = self.dims
        if not self._mla.is_graph(batch.batch_size) or index.indices.device.type != "cpu":
            return False
        if not can_replan(wrapper, causal, index.page_size, d.softmax_scale, self.pool.dtype):
            return False
        host = self._mla.buffers(self.graph_slot).upload(
            np.asarray(batch.qo_indptr, dtype=np.int32),
            index.indptr.numpy(),
            index.lens.numpy(),
            index.indices.numpy(),
        )
        replan(wrapper, host, d.num_heads, d.kv_lora_rank)
        return True

    def _plan_mha(self, batch: ForwardBatch) -> None:
        self._extend.plan(batch)
        self._mha_planned = True
        self._mark_planned()

    def _check_call(self, scale: float) -> ForwardBatch:
        if self._batch is None:
            raise RuntimeError("plan(batch) must be called before forward")
        if not math.isclose(scale, self.dims.softmax_scale, rel_tol=1e-6):
            raise ValueError(
                f"flashinfer plans with softmax scale {self.dims.softmax_scale}, "
                f"called with {scale}"
            )
        return self._batch

    # ---- per layer -----------------------------------------------------------------------
    def write_slots(self) -> torch.Tensor:
        if self._batch is None:
            raise RuntimeError("plan(batch) must be called before forward")
        return self._batch.out_slots

    def forward_absorbed(
        self, q_latent: torch.Tensor, q_pe: torch.Tensor, layer_id: int, scale: float
    ) -> torch.Tensor:
        batch = self._check_call(scale)
        if self._mla_run is None:
            self._plan_absorbed(batch)
        assert self._mla_run is not None
        wrapper, views = self._mla_run
        ckv, kpe = views[layer_id]
        return wrapper.run(_unit_last_stride(q_latent), _unit_last_stride(q_pe), ckv, kpe)

    def forward_mha(
        self, q: torch.Tensor, layer_id: int, scale: float, expand_kv: ExpandKV
    ) -> torch.Tensor:
        batch = self._check_call(scale)
        if not self._mha_planned:
            self._plan_mha(batch)
        return self._extend.run(_unit_last_stride(q), layer_id, self.pool, expand_kv)


def _unit_last_stride(x: torch.Tensor) -> torch.Tensor:
    """The kernels take row and head strides but need the last dimension contiguous."""
    return x if x.stride(-1) == 1 else x.contiguous()
