"""The backend factories: which class a name builds, its capabilities, and what they log."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

import dsv3serve.attention.flashmla_backend as flashmla_backend
import dsv3serve.attention.triton_mla as triton_mla
from dsv3serve.attention import attention_backend_class, create_attention_backend
from dsv3serve.attention.base import CudaGraphLimits, MLADims
from dsv3serve.attention.flashinfer_backend import FlashInferMLAAttention
from dsv3serve.attention.flashmla_backend import FlashMLAAttention
from dsv3serve.attention.ref import TorchRefAttention
from dsv3serve.attention.triton_mla import TritonMLAAttention
from dsv3serve.moe import moe_backend_class
from dsv3serve.moe.gate import grouped_topk
from dsv3serve.moe.gate_triton import grouped_topk_fused
from dsv3serve.moe.ref import TorchRefMoE
from dsv3serve.moe.triton_moe import TritonMoE

FP8, BF16 = torch.float8_e4m3fn, torch.bfloat16
DIMS = MLADims(num_heads=4, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16,
               v_head_dim=16, softmax_scale=0.1)  # fmt: skip


def test_attention_class_lookup_and_capabilities() -> None:
    assert attention_backend_class("torch", FP8) is TorchRefAttention
    assert attention_backend_class("flashinfer", BF16) is FlashInferMLAAttention
    assert attention_backend_class("flashinfer", FP8) is TritonMLAAttention
    assert not TorchRefAttention.supports_cuda_graphs and TorchRefAttention.serves_fp8_pool
    assert FlashInferMLAAttention.supports_cuda_graphs
    assert not FlashInferMLAAttention.serves_fp8_pool
    assert TritonMLAAttention.supports_cuda_graphs and TritonMLAAttention.serves_fp8_pool
    assert TorchRefAttention.materialises_scores
    assert not FlashInferMLAAttention.materialises_scores
    assert not TritonMLAAttention.materialises_scores
    assert TorchRefAttention.fp8_scales == TritonMLAAttention.fp8_scales == "token"
    with pytest.raises(ValueError, match="supported"):
        attention_backend_class("flashmla3", BF16)


def test_flashmla_serves_both_pool_dtypes_with_per_layer_fp8_scales() -> None:
    assert attention_backend_class("flashmla", BF16) is FlashMLAAttention
    assert attention_backend_class("flashmla", FP8) is FlashMLAAttention
    assert FlashMLAAttention.supports_cuda_graphs and FlashMLAAttention.serves_fp8_pool
    assert FlashMLAAttention.fp8_scales == "layer" and not FlashMLAAttention.materialises_scores


class FakeTritonMLARecorder:
    """Stands in for TritonMLAAttention or FlashMLAAttention, whose kernels need a GPU:
    records its arguments."""

    supports_cuda_graphs = serves_fp8_pool = True

    def __init__(self, pool: object, dims: MLADims, cuda_graph: object = None) -> None:
        self.pool, self.dims, self.cuda_graph = pool, dims, cuda_graph


def test_flashinfer_over_fp8_pool_logs_what_runs(monkeypatch, caplog) -> None:
    monkeypatch.setattr(triton_mla, "TritonMLAAttention", FakeTritonMLARecorder)
    pool = SimpleNamespace(dtype=FP8, is_fp8=True, device=torch.device("cuda"))  # no GPU here
    with caplog.at_level(logging.INFO, logger="dsv3serve.attention"):
        attn = create_attention_backend("flashinfer", pool, DIMS.kv_lora_rank, DIMS)
    assert isinstance(attn, FakeTritonMLARecorder) and attn.pool is pool
    [record] = [r for r in caplog.records if r.name == "dsv3serve.attention"]
    assert record.levelno == logging.INFO
    message = record.getMessage()
    assert "flashinfer with kv_cache_dtype fp8_e4m3" in message
    assert "Triton MLA kernel over the fp8 pool" in message
    assert "prefill and extend run flashinfer ragged MHA" in message


def test_create_flashmla_passes_dims_and_graph_limits(monkeypatch, caplog) -> None:
    monkeypatch.setattr(flashmla_backend, "FlashMLAAttention", FakeTritonMLARecorder)
    pool = SimpleNamespace(dtype=FP8, is_fp8=True, device=torch.device("cuda"))  # no GPU here
    limits = CudaGraphLimits(4, 64, 8)
    with caplog.at_level(logging.INFO, logger="dsv3serve.attention"):
        attn = create_attention_backend("flashmla", pool, 512, DIMS, cuda_graph=limits)
    assert isinstance(attn, FakeTritonMLARecorder) and attn.cuda_graph is limits
    assert attn.dims is DIMS and not caplog.records  # the flashinfer fp8 note is not logged
    cpu = SimpleNamespace(dtype=BF16, is_fp8=False, device=torch.device("cpu"))
    with pytest.raises(ValueError, match="'flashmla' needs a CUDA device"):
        create_attention_backend("flashmla", cpu, 512, DIMS)
    with pytest.raises(ValueError, match="'flashmla' needs the model's MLADims"):
        create_attention_backend("flashmla", pool, 512)


def test_moe_class_lookup_and_capabilities() -> None:
    assert moe_backend_class("torch") is TorchRefMoE
    assert moe_backend_class("triton") is TritonMoE
    assert TorchRefMoE.route is grouped_topk and not TorchRefMoE.routes_in_kernel
    assert TritonMoE.route is grouped_topk_fused and TritonMoE.routes_in_kernel
    assert TritonMoE.packs_shared_expert and not TorchRefMoE.packs_shared_expert
    with pytest.raises(ValueError, match="supported"):
        moe_backend_class("cutlass")
