"""Torch reference attention backend (CPU and GPU): one sequence at a time, float32 math."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch

from dsv3serve.attention.base import ExpandKV, PooledAttentionBackend
from dsv3serve.forward_batch import ForwardBatch

if TYPE_CHECKING:
    from dsv3serve.kvcache.pool import MLAKVPool


class TorchRefAttention(PooledAttentionBackend):
    """Readable reference: gathers each sequence's latents and runs masked softmax."""

    materialises_scores = True

    def __init__(self, pool: MLAKVPool, kv_lora_rank: int) -> None:
        self.pool = pool
        self.rank = kv_lora_rank
        self._batch: ForwardBatch | None = None
        self._masks: list[torch.Tensor] = []

    def plan(self, batch: ForwardBatch) -> None:
        self._batch = batch
        self._masks = []
        for b in range(batch.batch_size):
            n_q = batch.qo_indptr[b + 1] - batch.qo_indptr[b]
            n_kv = batch.kv_indptr[b + 1] - batch.kv_indptr[b]
            q_pos = torch.arange(n_kv - n_q, n_kv, device=batch.input_ids.device)
            kv_pos = torch.arange(n_kv, device=batch.input_ids.device)
            self._masks.append(kv_pos[None, :] > q_pos[:, None])  # True = masked

    def write_slots(self) -> torch.Tensor:
        return self._need_batch().out_slots

    def _need_batch(self) -> ForwardBatch:
        if self._batch is None:
            raise RuntimeError("plan(batch) must be called before forward")
        return self._batch

    def _per_seq(self, layer_id: int) -> Iterator[tuple[slice, torch.Tensor, torch.Tensor]]:
        batch = self._need_batch()
        for b in range(batch.batch_size):
            slots = batch.kv_slots[batch.kv_indptr[b] : batch.kv_indptr[b + 1]]
            q_range = slice(batch.qo_indptr[b], batch.qo_indptr[b + 1])
            yield q_range, self.pool.read(layer_id, slots).float(), self._masks[b]

    @staticmethod
    def _softmax_av(scores: torch.Tensor, mask: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """scores [H, q, S], mask [q, S], v [H or 1, S, D] -> [q, H, D]."""
        probs = scores.masked_fill(mask[None], float("-inf")).softmax(dim=-1)
        return (probs @ v).transpose(0, 1)

    def forward_absorbed(
        self, q_latent: torch.Tensor, q_pe: torch.Tensor, layer_id: int, scale: float
    ) -> torch.Tensor:
        out = torch.empty_like(q_latent, dtype=torch.float32)
        for q_range, latent, mask in self._per_seq(layer_id):
            c, k_pe = latent[:, : self.rank], latent[:, self.rank :]
            ql = q_latent[q_range].float().transpose(0, 1)  # [H, q, 512]
            qp = q_pe[q_range].float().transpose(0, 1)  # [H, q, 64]
            scores = (ql @ c.t() + qp @ k_pe.t()) * scale
            out[q_range] = self._softmax_av(scores, mask, c[None])
        return out.to(q_latent.dtype)

    def forward_mha(
        self, q: torch.Tensor, layer_id: int, scale: float, expand_kv: ExpandKV
    ) -> torch.Tensor:
        outs = []
        for q_range, latent, mask in self._per_seq(layer_id):
            k, v = expand_kv(latent.to(q.dtype))  # [S, H, 192], [S, H, 128]
            qh = q[q_range].float().transpose(0, 1)  # [H, q, 192]
            scores = qh @ k.float().permute(1, 2, 0) * scale
            outs.append(self._softmax_av(scores, mask, v.float().transpose(0, 1)))
        return torch.cat(outs).to(q.dtype)
