"""What the FlashMLA backend needs of ``sgl-flash-mla``: the import (lazy, with a message
saying what to install), the layouts its dense decode kernels read (checked before use), and
the fixed scale of the e4m3 ``q`` its FP8 kernel takes. No ``flash_mla`` import at module
load."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeAlias

import torch

from dsv3serve.attention.base import MLADims

if TYPE_CHECKING:
    from dsv3serve.kvcache.pool import MLAKVPool

logger = logging.getLogger(__name__)

FLASH_MLA_VERSION = "1.0.0"  # sgl-flash-mla
PAGE_SIZE = 64  # the only page size FlashMLA's kernels read
LATENT_DIM, ROPE_DIM = 512, 64
DEFAULT_Q_SCALE = 1.0  # e4m3 q = clamp(q / q_scale, +-448): SGLang's unit descale_q


FlashMLAHandle: TypeAlias = Any
"""An object of the ``flash_mla`` package (a function, a class, a schedule). sgl-flash-mla
ships no type information, so these are untyped: this alias is that one gap, named once."""


@dataclass(frozen=True)
class FlashMLAOps:
    """The three entry points of ``flash_mla`` this backend calls."""

    with_kvcache: FlashMLAHandle  # flash_mla.flash_mla_with_kvcache
    decoding_metadata: FlashMLAHandle  # flash_mla.get_mla_decoding_metadata
    sched_meta: FlashMLAHandle  # flash_mla.flash_mla_interface.FlashMLASchedMeta (a class)


def import_flash_mla() -> FlashMLAOps:
    """``import flash_mla`` (with its legacy SM90 kernels), or ImportError saying what to
    install."""
    try:
        import flash_mla
        from flash_mla.flash_mla_interface import FlashMLASchedMeta
    except ImportError as err:
        raise ImportError(
            f"attention backend 'flashmla' needs sgl-flash-mla=={FLASH_MLA_VERSION} "
            "(pip install 'dsv3serve[gpu-kernels]', or with torch pinned: pip install "
            f"--no-deps sgl-flash-mla=={FLASH_MLA_VERSION}; it asks for torch>=2.14.1 but "
            f"runs under torch 2.11): {err}"
        ) from err
    if not flash_mla.has_legacy():
        raise ImportError("flash_mla was built without its legacy SM90 dense decode kernels")
    version = getattr(flash_mla, "__version__", "?")
    if version != FLASH_MLA_VERSION:
        logger.warning(
            "flash_mla %s found; this backend is tested with %s", version, FLASH_MLA_VERSION
        )
    return FlashMLAOps(
        flash_mla.flash_mla_with_kvcache, flash_mla.get_mla_decoding_metadata, FlashMLASchedMeta
    )


def check_flashmla(pool: MLAKVPool, dims: MLADims) -> None:
    """Raise, saying what was expected, unless FlashMLA can read ``pool`` for ``dims``."""
    if pool.page_size != PAGE_SIZE:
        raise ValueError(
            f"attention backend 'flashmla': found page_size {pool.page_size}, expected "
            f"{PAGE_SIZE} (FlashMLA's kernels read {PAGE_SIZE}-token pages)"
        )
    if (dims.kv_lora_rank, dims.qk_rope_head_dim) != (LATENT_DIM, ROPE_DIM):
        raise ValueError(
            f"attention backend 'flashmla': found kv_lora_rank {dims.kv_lora_rank} and "
            f"qk_rope_head_dim {dims.qk_rope_head_dim}, expected {LATENT_DIM} and {ROPE_DIM}"
        )
    if pool.kv_dim != dims.kv_cache_dim:
        raise ValueError(f"KV pool rows are {pool.kv_dim} wide, expected {dims.kv_cache_dim}")
    if pool.is_fp8 and pool.fp8_scales != "layer":
        raise ValueError(
            "attention backend 'flashmla' with an fp8 pool: found per-token scales, expected "
            "one scale per layer (MLAKVPool(fp8_scales='layer'); FlashMLA takes one descale_k)"
        )
    if not pool.is_fp8 and pool.dtype != torch.bfloat16:
        raise ValueError(f"attention backend 'flashmla' needs a bf16 or fp8 pool, got {pool.dtype}")
