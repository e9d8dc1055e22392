"""The bare FlashMLA rows of ``bench kernels --only mla`` (``flashmla-bf16-kernel``,
``flashmla-fp8-kernel``): ``flash_mla.flash_mla_with_kvcache`` alone, called as the
sgl-flash-mla probe (``/work/shared/probes/flashmla_probe.py``) called it, over the same pool,
batch and timing as the backend's rows, so the table shows what the backend adds per call.

- ``q`` is packed once, before timing ([B, 1, H, 576]; e4m3 for the fp8 row, with the
  backend's unit scale), so no per-call work on ``q`` is timed;
- fp8: metadata from ``get_mla_decoding_metadata(seq_lens, H, 1, is_fp8_kvcache=True,
  use_legacy=True)`` and unit ``descale_q`` / ``descale_k`` tensors;
- bf16: an empty ``FlashMLASchedMeta``, which the first (warm-up, untimed) call fills with
  the kernel's own schedule.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from dsv3serve.attention.flashmla_meta import query_groups
from dsv3serve.attention.flashmla_ops import LATENT_DIM, PAGE_SIZE
from dsv3serve.forward_batch import ForwardBatch
from dsv3serve.kernels.flashmla_q import pack_q
from dsv3serve.kvcache.pool import MLAKVPool


def _device_int32(array: np.ndarray, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(array, dtype=np.int32)).to(device)


def bare_call(
    batch: ForwardBatch,
    pool: MLAKVPool,
    q_latent: torch.Tensor,
    q_pe: torch.Tensor,
    softmax_scale: float,
) -> Callable[[int], torch.Tensor]:
    """``call(i)``: one kernel call over layer ``i`` (mod the pool's layers) of a decode
    batch (one new token per sequence)."""
    import flash_mla
    from flash_mla.flash_mla_interface import FlashMLASchedMeta

    [group] = query_groups(batch, PAGE_SIZE)
    if group.s_q != 1:
        raise ValueError(f"expected a decode batch (one new token a sequence), got {group.s_q}")
    table = _device_int32(group.block_table, pool.device)
    lens = _device_int32(group.seq_lens, pool.device)
    fp8 = pool.is_fp8
    q = pack_q(q_latent, q_pe, torch.float8_e4m3fn if fp8 else torch.bfloat16)
    q = q.view(q.shape[0], 1, q.shape[1], q.shape[2])
    sched, unit = FlashMLASchedMeta(), None
    if fp8:
        sched.tile_scheduler_metadata, sched.num_splits = flash_mla.get_mla_decoding_metadata(
            lens, q.shape[2], 1, is_fp8_kvcache=True, use_legacy=True
        )
        unit = torch.ones(1, dtype=torch.float32, device=pool.device)

    def call(i: int) -> torch.Tensor:
        kv = pool.kv_buffer(i % pool.num_layers).view(-1, PAGE_SIZE, 1, pool.kv_dim)
        out, _ = flash_mla.flash_mla_with_kvcache(
            q, kv, table, lens, LATENT_DIM, sched, softmax_scale=softmax_scale, causal=False,
            is_fp8_kvcache=fp8, use_legacy=True, descale_q=unit, descale_k=unit,
        )  # fmt: skip
        return out

    return call
