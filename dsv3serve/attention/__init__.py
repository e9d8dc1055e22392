"""MLA attention backends behind one interface; choose with :func:`create_attention_backend`."""

from __future__ import annotations

from typing import TYPE_CHECKING

from dsv3serve.attention.base import AttentionBackend, MLADims

if TYPE_CHECKING:
    from dsv3serve.attention.flashinfer_backend import CudaGraphLimits
    from dsv3serve.kvcache.pool import MLAKVPool

ATTENTION_BACKENDS = ("torch", "flashinfer")


def create_attention_backend(
    name: str,
    pool: MLAKVPool,
    kv_lora_rank: int,
    dims: MLADims | None = None,
    cuda_graph: CudaGraphLimits | None = None,
) -> AttentionBackend:
    """Build the named backend; raises ValueError naming the supported ones.

    ``flashinfer`` needs ``dims`` (it plans with the head shapes and softmax scale) and a
    CUDA pool; flashinfer itself is imported only here, on first use. ``cuda_graph``
    (flashinfer only) sizes its CUDA-graph-safe buffers. With an fp8 pool, which
    flashinfer's MLA kernels cannot read, ``flashinfer`` means our Triton decode kernel
    for the absorbed form and flashinfer's prefill over dequantised latents for the MHA
    form (:class:`~dsv3serve.attention.triton_mla.TritonMLAAttention`).
    """
    if name == "torch":
        from dsv3serve.attention.ref import TorchRefAttention

        return TorchRefAttention(pool, kv_lora_rank)
    if name == "flashinfer":
        if dims is None:
            raise ValueError("attention backend 'flashinfer' needs the model's MLADims")
        if pool.device.type != "cuda":
            raise ValueError(
                f"attention backend 'flashinfer' needs a CUDA device, got {pool.device}"
            )
        if pool.is_fp8:
            from dsv3serve.attention.triton_mla import TritonMLAAttention

            return TritonMLAAttention(pool, dims, cuda_graph=cuda_graph)
        from dsv3serve.attention.flashinfer_backend import FlashInferMLAAttention

        return FlashInferMLAAttention(pool, dims, cuda_graph=cuda_graph)
    raise ValueError(f"attention backend {name!r} unknown; supported: {list(ATTENTION_BACKENDS)}")
