"""Attention backend interface for MLA over the paged latent cache.

A backend is created once per model runner, ``plan()``-ed once per step, then called by
every layer. The cache holds per token per layer the 576-wide latent
``[kv_a_layernorm(c_kv) (512) | rotated k_pe (64)]``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch

from dsv3serve.config import MLAHeadShape
from dsv3serve.forward_batch import ForwardBatch
from dsv3serve.kernels.rope_kv import rope_kv_write, rope_ref

if TYPE_CHECKING:
    from dsv3serve.config import ModelConfig
    from dsv3serve.kvcache.pool import FP8Scales, MLAKVPool

# Maps cached latents [S, 576] to per-head keys [S, H, 192] and values [S, H, 128].
ExpandKV = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class MLADims(MLAHeadShape):
    """The attention shapes a kernel backend plans with (DeepSeek-V3: 128 heads, latent
    512 + rope 64, MHA q/k 192 = 128 + 64, v 128)."""

    num_heads: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    softmax_scale: float

    @classmethod
    def from_config(cls, cfg: ModelConfig, attn_tp_size: int = 1) -> MLADims:
        """The shapes of one rank: ``num_attention_heads / attn_tp_size`` heads."""
        return cls(
            cfg.num_attention_heads // attn_tp_size,
            cfg.kv_lora_rank,
            cfg.qk_nope_head_dim,
            cfg.qk_rope_head_dim,
            cfg.v_head_dim,
            cfg.softmax_scale,
        )


@dataclass(frozen=True)
class CudaGraphLimits:
    """Sizes of the preallocated buffers of a backend's CUDA-graph-safe absorbed path, for
    batches of up to ``max_batch_size`` sequences.

    ``max_kv_indices``: the most page ids (or slots, in the token fallback) of one batch.
    flashinfer gives each (slot, batch size) used its own wrapper (8 MiB device + 8 MiB
    pinned host buffers), each slot one set of index buffers (``max_kv_indices`` int32).
    ``max_pages_per_seq``: the most pages one sequence holds: the width of the FlashMLA
    backend's block table per slot (``max_batch_size`` rows, int32); 0: ``max_kv_indices``.
    """

    max_batch_size: int
    max_kv_indices: int
    max_pages_per_seq: int = 0

    @classmethod
    def for_pool(
        cls, max_batch_size: int, num_pages: int, page_size: int, max_seq_tokens: int
    ) -> CudaGraphLimits:
        """Limits for batches over a pool of ``num_pages`` pages whose sequences hold at most
        ``max_seq_tokens`` tokens (index buffers capped at 2**24 entries)."""
        per_seq = min(num_pages, -(-max_seq_tokens // page_size))
        return cls(max_batch_size, min(max_batch_size * num_pages, 1 << 24), per_seq)

    @property
    def block_table_width(self) -> int:
        """Columns of a fixed block table: ``max_pages_per_seq``, else ``max_kv_indices``."""
        return self.max_pages_per_seq or self.max_kv_indices


class AttentionBackend(ABC):
    """MLA attention over a paged latent KV cache.

    Capabilities (class attributes, so callers can ask before building one):
    ``supports_cuda_graphs``: decode batches may be captured into CUDA graphs (plans into
    fixed device buffers); ``serves_fp8_pool``: reads an fp8 pool; ``fp8_scales``: the
    scale granularity of the fp8 pool it reads (``"token"``: a float32 scale per token,
    ``"layer"``: one per layer; :class:`~dsv3serve.kvcache.pool.MLAKVPool`);
    ``materialises_scores``: a prefill holds the dense float32 attention scores
    [heads, L, L] in memory.
    """

    supports_cuda_graphs: ClassVar[bool] = False
    serves_fp8_pool: ClassVar[bool] = True
    fp8_scales: ClassVar[FP8Scales] = "token"
    materialises_scores: ClassVar[bool] = False

    @abstractmethod
    def plan(self, batch: ForwardBatch) -> None:
        """Prepare per-step metadata; called once per step before any layer runs."""

    @abstractmethod
    def save_latent(self, layer_id: int, latent: torch.Tensor) -> None:
        """Write the new tokens' latents [T, 576] at the batch's ``out_slots``."""

    def save_latent_roped(
        self,
        layer_id: int,
        latent: torch.Tensor,
        q_pe: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> torch.Tensor:
        """:meth:`save_latent` with RoPE applied on the way, and the query's rope part too.

        ``latent`` [T, 576] bf16, contiguous: ``[kv_a_layernorm(c_kv) (512) | k_pe (64)]``
        with ``k_pe`` not yet rotated; ``q_pe`` [T, H, 64] (unit last stride), not yet
        rotated; ``cos``/``sin`` [T, 32] float32. Saves ``[c_kv | rope(k_pe)]`` at the batch's
        ``out_slots`` and returns ``rope(q_pe)`` [T, H, 64] contiguous. Here: the reference
        ops, then :meth:`save_latent`; a backend over an ``MLAKVPool`` overrides it with
        :func:`write_roped_latent` (one kernel on CUDA).
        """
        r = latent.shape[1] - q_pe.shape[-1]
        rows = torch.cat([latent[:, :r], rope_ref(latent[:, r:], cos, sin)], -1)
        self.save_latent(layer_id, rows)
        return rope_ref(q_pe, cos, sin)

    @abstractmethod
    def forward_absorbed(
        self, q_latent: torch.Tensor, q_pe: torch.Tensor, layer_id: int, scale: float
    ) -> torch.Tensor:
        """Weight-absorbed MQA form.

        q_latent [T, H, 512] (q_nope already multiplied by W_UK), q_pe [T, H, 64].
        Attends causally to each sequence's cached latents; returns [T, H, 512] in the
        latent space (the caller applies W_UV).
        """

    @abstractmethod
    def forward_mha(
        self, q: torch.Tensor, layer_id: int, scale: float, expand_kv: ExpandKV
    ) -> torch.Tensor:
        """MHA form: q [T, H, 192]; K/V decompressed from the cache by ``expand_kv``.

        Returns [T, H, v_head_dim].
        """


def write_roped_latent(
    pool: MLAKVPool,
    layer_id: int,
    slots: torch.Tensor,
    latent: torch.Tensor,
    q_pe: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> torch.Tensor:
    """:meth:`AttentionBackend.save_latent_roped` into ``pool`` at ``slots``, through
    :func:`~dsv3serve.kernels.rope_kv.rope_kv_write` (the kernel on CUDA, else its
    reference, which writes what ``pool.write`` writes)."""
    kv, scales = pool.kv_buffer(layer_id), pool.scale_buffer(layer_id)
    q = rope_kv_write(latent, cos, sin, slots, kv, scales, q_pe, pool.layer_inv_scale(layer_id))
    assert q is not None
    return q


class PooledAttentionBackend(AttentionBackend):
    """A backend whose latents live in an :class:`MLAKVPool` (``pool``) at the planned
    batch's output slots (:meth:`write_slots`): both saves write there, the roped one through
    :func:`write_roped_latent`."""

    pool: MLAKVPool

    @abstractmethod
    def write_slots(self) -> torch.Tensor:
        """The planned batch's output slots [T] (int64); raises before ``plan``."""

    def save_latent(self, layer_id: int, latent: torch.Tensor) -> None:
        self.pool.write(layer_id, self.write_slots(), latent)

    def save_latent_roped(
        self,
        layer_id: int,
        latent: torch.Tensor,
        q_pe: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> torch.Tensor:
        slots = self.write_slots()
        return write_roped_latent(self.pool, layer_id, slots, latent, q_pe, cos, sin)
