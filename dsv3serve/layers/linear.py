"""Linear layers: bf16 (or fp32) weights, or FP8 e4m3 weights with 128x128 block scales.

:func:`is_fp8_layer` is the one place that decides which checkpoint layers are FP8.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dsv3serve.config import ModelConfig
from dsv3serve.kernels.fp8_gemm import fp8_block_gemm, fp8_block_gemm_quantized
from dsv3serve.kernels.fp8_quant import HAS_TRITON
from dsv3serve.kernels.fp8_ref import BLOCK, FP8_DTYPE, dequant_weight_block, fp8_block_linear_ref

# Suffixes of modules that stay in bf16 in DeepSeek's FP8 checkpoints.
_BF16_SUFFIXES = ("mlp.gate", "eh_proj", "shared_head.head", "lm_head")


def is_fp8_layer(cfg: ModelConfig, prefix: str) -> bool:
    """Whether the linear named ``prefix`` holds e4m3 weights in this checkpoint."""
    return cfg.quant_method == "fp8" and not prefix.endswith(_BF16_SUFFIXES)


def fp8_kernels_apply(x: torch.Tensor, act_quant: bool) -> bool:
    """The switch between the FP8 kernels and the torch reference: kernels only for bf16
    activations on CUDA with Triton installed, quantised per 1x128 group. Everything else
    (CPU, float32 compute, ``act_quant=False``) keeps the reference."""
    return fp8_kernels_run(x.device, x.dtype, act_quant)


def fp8_kernels_run(device: torch.device, dtype: torch.dtype, act_quant: bool) -> bool:
    """:func:`fp8_kernels_apply` for activations of ``dtype`` on ``device`` (a decision made
    once, before any activation exists)."""
    return HAS_TRITON and device.type == "cuda" and dtype == torch.bfloat16 and act_quant


def fp8_linear(
    x: torch.Tensor, weight: torch.Tensor, weight_scale_inv: torch.Tensor, act_quant: bool = True
) -> torch.Tensor:
    """FP8 block-scaled linear: x [.., K] (bf16/fp32), weight e4m3 [N, K], scales [N/128, K/128]."""
    if not fp8_kernels_apply(x, act_quant):
        return fp8_block_linear_ref(x, weight, weight_scale_inv, act_quant)
    x2 = x.reshape(-1, x.shape[-1])
    y = fp8_block_gemm(x2 if x2.stride(1) == 1 else x2.contiguous(), weight, weight_scale_inv)
    return y.view(*x.shape[:-1], weight.shape[0])


class Linear(nn.Module):
    """``y = x @ W.T`` without bias; FP8 when built with ``fp8=True``."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        fp8: bool,
        dtype: torch.dtype,
        act_quant: bool = True,
    ) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.act_quant = act_quant
        wdtype = FP8_DTYPE if fp8 else dtype
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=wdtype), False)
        self.weight_scale_inv: nn.Parameter | None = None
        if fp8:
            shape = (-(-out_features // BLOCK), -(-in_features // BLOCK))
            self.weight_scale_inv = nn.Parameter(torch.empty(shape, dtype=torch.float32), False)

    @property
    def is_fp8(self) -> bool:
        return self.weight_scale_inv is not None

    def dequantized_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight as real values [N, K] in ``dtype``."""
        if self.weight_scale_inv is None:
            return self.weight.to(dtype)
        return dequant_weight_block(self.weight, self.weight_scale_inv).to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight_scale_inv is None:
            return F.linear(x, self.weight)
        return fp8_linear(x, self.weight, self.weight_scale_inv, self.act_quant)

    def takes_quantized(self, device: torch.device, dtype: torch.dtype) -> bool:
        """Whether :meth:`forward_quantized` may stand in for ``forward(x)`` for activations
        of ``dtype`` on ``device``: an FP8 weight and the FP8 kernels (not the reference)
        running for them."""
        return self.is_fp8 and fp8_kernels_run(device, dtype, self.act_quant)

    def forward_quantized(self, xq: torch.Tensor, xs: torch.Tensor) -> torch.Tensor:
        """``forward`` over input already quantised per 1x128 group: ``xq`` [M, K] e4m3,
        ``xs`` [M, K/128] float32 with strides ``(1, M)``; returns bf16 [M, N]. Only where
        :meth:`takes_quantized` holds."""
        assert self.weight_scale_inv is not None, "forward_quantized needs an FP8 weight"
        return fp8_block_gemm_quantized(xq, xs, self.weight, self.weight_scale_inv)
