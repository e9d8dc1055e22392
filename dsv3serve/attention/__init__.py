"""MLA attention backends behind one interface; choose with :func:`create_attention_backend`
(or ask :func:`attention_backend_class` what a name would build, before building it)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from dsv3serve.attention.base import AttentionBackend, MLADims

if TYPE_CHECKING:
    from dsv3serve.attention.base import CudaGraphLimits
    from dsv3serve.kvcache.pool import MLAKVPool

logger = logging.getLogger(__name__)

ATTENTION_BACKENDS = ("torch", "flashinfer", "flashmla")


def attention_backend_class(name: str, kv_dtype: torch.dtype) -> type[AttentionBackend]:
    """The class ``create_attention_backend(name, pool)`` builds for a pool of ``kv_dtype``;
    its class attributes answer capability questions (CUDA graphs, fp8 pools).

    ``flashinfer`` over an fp8 pool, which flashinfer's MLA kernels cannot read, is
    :class:`~dsv3serve.attention.triton_mla.TritonMLAAttention`: our Triton kernel for the
    absorbed form, flashinfer's ragged prefill over dequantised latents for the MHA form.
    ``flashmla`` is :class:`~dsv3serve.attention.flashmla_backend.FlashMLAAttention` for
    both pool dtypes (its module does not import ``flash_mla``; building one does).
    """
    if name == "torch":
        from dsv3serve.attention.ref import TorchRefAttention

        return TorchRefAttention
    if name == "flashmla":
        from dsv3serve.attention.flashmla_backend import FlashMLAAttention

        return FlashMLAAttention
    if name == "flashinfer":
        from dsv3serve.attention.flashinfer_backend import FlashInferMLAAttention
        from dsv3serve.attention.triton_mla import TritonMLAAttention

        fp8 = kv_dtype == torch.float8_e4m3fn
        return TritonMLAAttention if fp8 else FlashInferMLAAttention
    raise ValueError(f"attention backend {name!r} unknown; supported: {list(ATTENTION_BACKENDS)}")


def create_attention_backend(
    name: str,
    pool: MLAKVPool,
    kv_lora_rank: int,
    dims: MLADims | None = None,
    cuda_graph: CudaGraphLimits | None = None,
) -> AttentionBackend:
    """Build the named backend (the class :func:`attention_backend_class` names); raises
    ValueError naming the supported ones.

    ``flashinfer`` and ``flashmla`` need ``dims`` (they plan with the head shapes) and a
    CUDA pool (``flashmla``: of 64-token pages, fp8 with one scale per layer); their kernel
    packages are imported only here, on first use. ``cuda_graph`` (not ``torch``) sizes
    their CUDA-graph-safe buffers.
    """
    if name == "torch":
        from dsv3serve.attention.ref import TorchRefAttention

        return TorchRefAttention(pool, kv_lora_rank)
    cls = attention_backend_class(name, pool.dtype)  # ValueError for an unknown name
    if dims is None:
        raise ValueError(f"attention backend {name!r} needs the model's MLADims")
    if pool.device.type != "cuda":
        raise ValueError(f"attention backend {name!r} needs a CUDA device, got {pool.device}")
    if pool.is_fp8 and name == "flashinfer":
        logger.info(
            "attention_backend flashinfer with kv_cache_dtype fp8_e4m3: decode and verify run "
            "the Triton MLA kernel over the fp8 pool (flashinfer's MLA needs a bf16 cache); "
            "prefill and extend run flashinfer ragged MHA over latents dequantised to bf16"
        )
    from dsv3serve.attention.flashinfer_backend import FlashInferMLAAttention
    from dsv3serve.attention.flashmla_backend import FlashMLAAttention
    from dsv3serve.attention.triton_mla import TritonMLAAttention

    assert issubclass(cls, (FlashInferMLAAttention, FlashMLAAttention, TritonMLAAttention))
    return cls(pool, dims, cuda_graph=cuda_graph)
