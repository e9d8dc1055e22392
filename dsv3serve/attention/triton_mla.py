"""MLA attention whose absorbed form (decode, speculative verify) runs our Triton kernel.

The fast backend for an fp8 KV cache (``attention_backend='flashinfer'`` with
``kv_cache_dtype='fp8_e4m3'``), which flashinfer's MLA kernels cannot read as the pool lays
it out; it reads bf16 pools too (for comparison with flashinfer).

- Absorbed form: :func:`dsv3serve.kernels.mla_decode.mla_decode` (fp8 rows dequantised in
  registers, bf16 dots; ``fp8_kernel='dequant'``, the default), or over an fp8 pool with
  ``fp8_kernel='mma'`` :func:`dsv3serve.kernels.mla_decode_fp8.mla_decode_fp8` (q and the
  probabilities rounded to e4m3, FP8 tensor-core dots straight on the e4m3 rows). Both
  read the pool in place. Causal, bottom-right aligned for several new tokens per sequence
  (verify). KV is indexed by page when every sequence fills its pages in order, else token
  by token (each slot a page of one row).
- MHA form (prefill, extend): on CUDA, flashinfer's ragged prefill
  (:class:`~dsv3serve.attention.flashinfer_mha.FlashInferExtend`) over the latents
  ``MLAKVPool.read`` dequantises to bf16 for just the slots a step needs; elsewhere (CPU
  tests) the torch reference.
- CUDA graphs: with :class:`~dsv3serve.attention.flashinfer_backend.CudaGraphLimits`, a
  batch of up to ``max_batch_size`` sequences plans into fixed device buffers, one set per
  (``graph_slot``, token count) for the per-token metadata and one page-id buffer per
  ``graph_slot``; the number of KV splits depends only on the token count. So a graph
  captured after one ``plan()`` replays correctly after a later ``plan()`` of the same shape.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch

from dsv3serve.attention.base import AttentionBackend, ExpandKV, MLADims, PooledAttentionBackend
from dsv3serve.attention.flashinfer_meta import (
    KVIndex,
    batch_kv_index,
    seq_lens,
)
from dsv3serve.forward_batch import ForwardBatch
from dsv3serve.kernels.mla_decode import (
    MLADecodeConfig,
    MLADecodeMeta,
    mla_decode,
    num_splits_for,
)
from dsv3serve.kernels.mla_decode_fp8 import FP8MLAConfig, fp8_num_splits, mla_decode_fp8

if TYPE_CHECKING:
    from dsv3serve.attention.flashinfer_backend import CudaGraphLimits
    from dsv3serve.kvcache.pool import MLAKVPool

logger = logging.getLogger(__name__)

FP8_KERNELS = ("mma", "dequant")  # an fp8 pool's absorbed-form kernel: FP8 dots, or bf16

DEFAULT_SMS = 132  # H100 / H200 multiprocessors, where the device cannot say (CPU)


def token_meta(qo_indptr: list[int], index: KVIndex) -> tuple[torch.Tensor, torch.Tensor]:
    """Per query token (host int32): its sequence's first page in ``index.indices`` and the
    number of cached tokens it sees (bottom-right causal: query ``j`` of ``n`` new tokens
    of a sequence of ``L`` sees ``L - n + 1 + j``)."""
    q_lens = seq_lens(qo_indptr)
    seq = torch.repeat_interleave(torch.arange(len(q_lens)), q_lens)
    j = torch.arange(int(q_lens.sum())) - torch.tensor(qo_indptr[:-1])[seq]
    kv_len = index.lens.long()[seq] - q_lens[seq] + 1 + j
    return index.indptr.long()[seq].int(), kv_len.int()


class _GraphMeta:
    """Fixed metadata buffers of the CUDA-graph path, by slot and token count."""

    def __init__(self, limits: CudaGraphLimits, device: torch.device) -> None:
        self.limits, self.device = limits, device
        self._indices: dict[str, torch.Tensor] = {}
        self._per_token: dict[tuple[str, int], tuple[torch.Tensor, torch.Tensor]] = {}

    def fits(self, batch_size: int) -> bool:
        return batch_size <= self.limits.max_batch_size

    def load(
        self, slot: str, indices: torch.Tensor, page_start: torch.Tensor, kv_len: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Copy a plan (device tensors) into the slot's buffers: stream-ordered, so after
        earlier replays read them."""
        n = int(indices.shape[0])
        if n > self.limits.max_kv_indices:
            raise ValueError(
                f"expected at most {self.limits.max_kv_indices} KV indices for a CUDA-graph "
                f"batch (CudaGraphLimits.max_kv_indices), got {n}"
            )
        if slot not in self._indices:
            self._indices[slot] = self._zeros(self.limits.max_kv_indices)
        key = (slot, int(kv_len.shape[0]))
        if key not in self._per_token:
            self._per_token[key] = (self._zeros(key[1]), self._zeros(key[1]))
        buf_idx, (buf_start, buf_len) = self._indices[slot], self._per_token[key]
        buf_idx[:n].copy_(indices)
        buf_start.copy_(page_start)
        buf_len.copy_(kv_len)
        return buf_idx, buf_start, buf_len

    def _zeros(self, n: int) -> torch.Tensor:
        return torch.zeros(n, dtype=torch.int32, device=self.device)


class TritonMLAAttention(PooledAttentionBackend):
    """MLA over the paged latent cache (bf16 or fp8): Triton absorbed form, see module doc."""

    supports_cuda_graphs = True
    serves_fp8_pool = True

    def __init__(
        self,
        pool: MLAKVPool,
        dims: MLADims,
        *,
        cuda_graph: CudaGraphLimits | None = None,
        config: MLADecodeConfig | None = None,
        paged: bool = True,
        extend: AttentionBackend | None = None,
        fp8_kernel: str = "dequant",
        fp8_config: FP8MLAConfig | None = None,
    ) -> None:
        """``extend``: the MHA-form backend (default: flashinfer on CUDA, else torch).
        ``fp8_kernel`` (fp8 pools): ``dequant`` (the default: the bf16 kernel over
        dequantised rows, ``config``) or ``mma`` (the FP8 tensor-core kernel, ``fp8_config``;
        not the default until it is timed against flashinfer and its accuracy cost, ~4-6%
        relative error in the attention output from rounding q and P to e4m3, is judged on
        a model; no engine flag selects it yet, only the MLA bench and the tests)."""
        if pool.kv_dim != dims.kv_cache_dim:
            raise ValueError(
                f"KV pool rows are {pool.kv_dim} wide, expected kv_lora_rank + "
                f"qk_rope_head_dim = {dims.kv_cache_dim}"
            )
        if pool.is_fp8 and not pool.token_scales:
            raise ValueError("TritonMLAAttention reads fp8 pools with per-token scales only")
        if fp8_kernel not in FP8_KERNELS:
            raise ValueError(f"fp8_kernel: expected one of {FP8_KERNELS}, got {fp8_kernel!r}")
        self.pool, self.dims, self.paged = pool, dims, paged
        self.config = config or MLADecodeConfig()
        self.fp8_config = fp8_config or FP8MLAConfig()
        self.fp8_mma = pool.is_fp8 and fp8_kernel == "mma"
        self._graph = None if cuda_graph is None else _GraphMeta(cuda_graph, pool.device)
        self._extend = extend or _default_extend(pool, dims)
        self._sms = _num_sms(pool.device)
        self._batch: ForwardBatch | None = None
        self._meta: MLADecodeMeta | None = None
        self._mha_planned = False
        self._warned_unaligned = False
        self.graph_slot = "decode"  # CUDA-graph buffers this instance plans into
        self.index_mode = ""  # "page" or "token": how the last absorbed plan indexed KV

    @property
    def meta(self) -> MLADecodeMeta | None:
        """The decode metadata the last plan built (None before a plan, or for an extend
        batch until its absorbed form runs)."""
        return self._meta

    # ---- planning ------------------------------------------------------------------------
    def plan(self, batch: ForwardBatch) -> None:
        self._batch, self._meta, self._mha_planned = batch, None, False
        if batch.is_decode:
            self._meta = self._plan_absorbed(batch)
        else:
            self._extend.plan(batch)
            self._mha_planned = True

    def _kv_index(self, batch: ForwardBatch) -> KVIndex:
        index, fallback = batch_kv_index(batch, self.pool.page_size, self.paged)
        if fallback and not self._warned_unaligned:
            logger.warning("triton MLA: %s; using token-granular KV indices", fallback)
            self._warned_unaligned = True
        return index

    def _plan_absorbed(self, batch: ForwardBatch) -> MLADecodeMeta:
        index = self._kv_index(batch)
        page_start, kv_len = token_meta(batch.qo_indptr, index)
        indices, page_start, kv_len = _to_device(
            [index.indices, page_start, kv_len], self.pool.device
        )
        if self._graph is not None and self._graph.fits(batch.batch_size):
            indices, page_start, kv_len = self._graph.load(
                self.graph_slot, indices, page_start, kv_len
            )
        self.index_mode = "token" if index.page_size == 1 else "page"
        return MLADecodeMeta(indices, page_start, kv_len, index.page_size, self._splits(batch))

    def _splits(self, batch: ForwardBatch) -> int:
        """KV splits per query token (fixed per token count: CUDA graphs replay it)."""
        tokens, heads = batch.num_tokens, self.dims.num_heads
        if self.fp8_mma:
            return fp8_num_splits(tokens, heads, self.fp8_config, self._sms)
        return num_splits_for(tokens, heads, self.config, self._sms)

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
        if self._meta is None:  # a forced absorbed form on an extend batch
            self._meta = self._plan_absorbed(batch)
        kv = self.pool.kv_buffer(layer_id)
        if self._meta.page_size == 1:
            kv = kv.view(-1, 1, kv.shape[-1])
        scales = self.pool.scale_buffer(layer_id)
        q_latent, q_pe = _unit_last_stride(q_latent), _unit_last_stride(q_pe)
        if self.fp8_mma:
            return mla_decode_fp8(q_latent, q_pe, kv, scales, self._meta, scale, self.fp8_config)
        return mla_decode(q_latent, q_pe, kv, scales, self._meta, scale, self.config)

    def forward_mha(
        self, q: torch.Tensor, layer_id: int, scale: float, expand_kv: ExpandKV
    ) -> torch.Tensor:
        batch = self._need_batch()
        if not self._mha_planned:  # a forced MHA form on a decode batch
            self._extend.plan(batch)
            self._mha_planned = True
        return self._extend.forward_mha(q, layer_id, scale, expand_kv)


def _to_device(tensors: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """int32 copies on ``device``; the host ones travel together in one pinned,
    asynchronous copy (no host sync, so planning can overlap the previous step)."""
    host = [t.to(torch.int32).flatten() for t in tensors if t.device.type == "cpu"]
    moved: Iterator[torch.Tensor] = iter(())
    if host:
        flat = torch.cat(host)
        if device.type == "cuda":
            flat = flat.pin_memory()
        moved = iter(flat.to(device, non_blocking=True).split([t.numel() for t in host]))
    return [next(moved) if t.device.type == "cpu" else t.to(torch.int32) for t in tensors]


def _unit_last_stride(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return DEFAULT_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def _default_extend(pool: MLAKVPool, dims: MLADims) -> AttentionBackend:
    if pool.device.type == "cuda":
        from dsv3serve.attention.triton_mla_extend import FlashInferExtendBackend

        return FlashInferExtendBackend(pool, dims)
    from dsv3serve.attention.ref import TorchRefAttention

    return TorchRefAttention(pool, dims.kv_lora_rank)
