"""The MHA form (prefill / extend) on flashinfer's ragged prefill kernels.

Per step: the new tokens attend to themselves causally (one ragged prefill whose K/V are
the new tokens' latents expanded with ``kv_b_proj``); a sequence's cached prefix is
attended non-causally in chunks of at most ``max_prefix_tokens`` keys for the whole
batch (so the expanded K/V of a long prefix never has to fit at once); the partial
results are merged through their log-sum-exp with ``merge_state_in_place``.

flashinfer's LSE is base 2 of the scaled scores, the form ``merge_state_in_place``
consumes. A sequence with no keys in a chunk gets O = 0 and LSE = -inf there (flashinfer
writes that for an empty KV range); such rows are also masked out of the merge, so they
never touch the result.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import ModuleType
from typing import Any, TypeAlias

import torch

from dsv3serve.attention.base import ExpandKV, MLADims
from dsv3serve.attention.flashinfer_meta import int32_host, prefix_chunks
from dsv3serve.forward_batch import ForwardBatch
from dsv3serve.kvcache.pool import MLAKVPool

# merge_state_in_place launches one block of (head_dim / 8) x num_heads threads per row;
# 128 heads of 128 would need 2048 > 1024 threads, so rows are split into head groups.
MERGE_MAX_HEADS = 32


RaggedWrapper: TypeAlias = Any
"""A ``flashinfer.BatchPrefillWithRaggedKVCacheWrapper``: flashinfer ships no type
information, so its wrappers are untyped; this alias names that one gap in this module."""


@dataclass
class _Chunk:
    wrapper: RaggedWrapper  # planned
    slots: torch.Tensor  # [keys] int64 cache slots, device
    merge_rows: torch.Tensor | None  # [T * groups] uint8, device; None = every row


class FlashInferExtend:
    """Planned once per step by :meth:`plan`; :meth:`run` per layer."""

    def __init__(
        self,
        fi: ModuleType,
        workspace: torch.Tensor,
        dims: MLADims,
        dtype: torch.dtype,
        max_prefix_tokens: int,
    ) -> None:
        if max_prefix_tokens < 1:
            raise ValueError(f"max_prefix_tokens must be >= 1, got {max_prefix_tokens}")
        self._fi, self._workspace, self.dims, self.dtype = fi, workspace, dims, dtype
        self.max_prefix_tokens = max_prefix_tokens
        self._new = fi.BatchPrefillWithRaggedKVCacheWrapper(workspace, "NHD")
        self._prefix_wrappers: list[RaggedWrapper] = []  # one per chunk, kept across steps
        self._groups = dims.num_heads // math.gcd(dims.num_heads, MERGE_MAX_HEADS)
        self._out_slots: torch.Tensor | None = None
        self._chunks: list[_Chunk] = []

    @property
    def num_chunks(self) -> int:
        """Prefix chunks of the planned step (0: no sequence has cached tokens)."""
        return len(self._chunks)

    def plan(self, batch: ForwardBatch) -> None:
        """Plan the new-token pass and every prefix chunk of ``batch``."""
        qo = int32_host(batch.qo_indptr)
        self._plan(self._new, qo, qo, causal=True)
        chunks = prefix_chunks(
            batch.qo_indptr, batch.kv_indptr, self.max_prefix_tokens, self._groups
        )
        while len(self._prefix_wrappers) < len(chunks):
            wrapper = self._fi.BatchPrefillWithRaggedKVCacheWrapper(self._workspace, "NHD")
            self._prefix_wrappers.append(wrapper)
        device = batch.input_ids.device  # kv_slots is built below only if a prefix exists
        self._chunks = []
        for wrapper, chunk in zip(self._prefix_wrappers, chunks, strict=False):
            self._plan(wrapper, qo, chunk.kv_indptr, causal=False)
            slots = batch.kv_slots[chunk.kv_positions.to(device)]
            rows = None if chunk.merge_rows is None else chunk.merge_rows.to(device)
            self._chunks.append(_Chunk(wrapper, slots, rows))
        self._out_slots = batch.out_slots

    def _plan(
        self, wrapper: RaggedWrapper, qo: torch.Tensor, kv: torch.Tensor, causal: bool
    ) -> None:
        d = self.dims
        wrapper.plan(
            qo,
            kv,
            d.num_heads,
            d.num_heads,
            d.qk_head_dim,
            head_dim_vo=d.v_head_dim,
            causal=causal,
            sm_scale=d.softmax_scale,
            q_data_type=self.dtype,
            kv_data_type=self.dtype,
        )

    def run(
        self, q: torch.Tensor, layer_id: int, pool: MLAKVPool, expand_kv: ExpandKV
    ) -> torch.Tensor:
        """q [T, H, qk_head_dim] -> [T, H, v_head_dim] over each sequence's whole KV."""
        if self._out_slots is None:
            raise RuntimeError("plan(batch) must be called before run")
        latent = pool.read(layer_id, self._out_slots)
        if not self._chunks:
            return self._attend(self._new, q, latent, expand_kv)
        out, lse = self._attend_lse(self._new, q, latent, expand_kv)
        for chunk in self._chunks:
            latent = pool.read(layer_id, chunk.slots)
            part, part_lse = self._attend_lse(chunk.wrapper, q, latent, expand_kv)
            self._merge(out, lse, part, part_lse, chunk.merge_rows)
        return out

    @staticmethod
    def _attend(
        wrapper: RaggedWrapper, q: torch.Tensor, latent: torch.Tensor, expand_kv: ExpandKV
    ) -> torch.Tensor:
        k, v = expand_kv(latent)  # [S, H, 192] contiguous, [S, H, 128] a strided view
        return wrapper.run(q, k, v.contiguous())

    @staticmethod
    def _attend_lse(
        wrapper: RaggedWrapper, q: torch.Tensor, latent: torch.Tensor, expand_kv: ExpandKV
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`_attend` with the rows' log-sum-exp, for merging."""
        k, v = expand_kv(latent)
        out, lse = wrapper.run(q, k, v.contiguous(), return_lse=True)
        return out, lse

    def _merge(
        self,
        out: torch.Tensor,
        lse: torch.Tensor,
        part: torch.Tensor,
        part_lse: torch.Tensor,
        rows: torch.Tensor | None,
    ) -> None:
        """``out, lse <- merge((out, lse), (part, part_lse))`` in place, head groups as rows."""
        t, h, d = out.shape
        g = self._groups
        self._fi.merge_state_in_place(
            out.view(t * g, h // g, d),
            lse.view(t * g, h // g),
            part.view(t * g, h // g, d),
            part_lse.view(t * g, h // g),
            rows,
        )
