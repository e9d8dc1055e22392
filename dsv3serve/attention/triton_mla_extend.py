"""The MHA form (prefill / extend) of :class:`~dsv3serve.attention.triton_mla.TritonMLAAttention`
and :class:`~dsv3serve.attention.flashmla_backend.FlashMLAAttention`: flashinfer's ragged
prefill over latents that ``MLAKVPool.read`` returns in the pool's compute dtype (bf16; an
fp8 pool, of either scale layout, dequantises only the slots a step reads).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from dsv3serve.attention.base import AttentionBackend, ExpandKV, MLADims
from dsv3serve.attention.flashinfer_backend import (
    DEFAULT_PREFIX_CHUNK_TOKENS,
    WORKSPACE_BYTES,
    import_flashinfer,
)
from dsv3serve.attention.flashinfer_mha import FlashInferExtend
from dsv3serve.forward_batch import ForwardBatch

if TYPE_CHECKING:
    from dsv3serve.kvcache.pool import MLAKVPool


class FlashInferExtendBackend(AttentionBackend):
    """Only ``plan`` (of extend batches) and ``forward_mha``; the owner saves latents."""

    def __init__(
        self,
        pool: MLAKVPool,
        dims: MLADims,
        max_prefix_chunk_tokens: int = DEFAULT_PREFIX_CHUNK_TOKENS,
        workspace_bytes: int = WORKSPACE_BYTES,
    ) -> None:
        fi = import_flashinfer()
        self.pool = pool
        workspace = torch.empty(workspace_bytes, dtype=torch.uint8, device=pool.device)
        self._extend = FlashInferExtend(
            fi, workspace, dims, pool.compute_dtype, max_prefix_chunk_tokens
        )
        self._planned: torch.Event | None = None

    def plan(self, batch: ForwardBatch) -> None:
        # flashinfer stages plan data in pinned buffers copied asynchronously: wait for the
        # previous copy before replanning (a no-op in the engine, which syncs every step).
        if self._planned is not None:
            self._planned.synchronize()
        self._extend.plan(batch)
        if self.pool.device.type == "cuda":  # (CPU tests run a stand-in flashinfer)
            self._planned = torch.Event(device=self.pool.device)
            self._planned.record()

    def save_latent(self, layer_id: int, latent: torch.Tensor) -> None:
        raise NotImplementedError("the owning backend saves latents")

    def forward_absorbed(
        self, q_latent: torch.Tensor, q_pe: torch.Tensor, layer_id: int, scale: float
    ) -> torch.Tensor:
        raise NotImplementedError("the owning backend runs the absorbed form")

    def forward_mha(
        self, q: torch.Tensor, layer_id: int, scale: float, expand_kv: ExpandKV
    ) -> torch.Tensor:
        q = q if q.stride(-1) == 1 else q.contiguous()
        return self._extend.run(q, layer_id, self.pool, expand_kv)
