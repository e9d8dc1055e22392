"""RMSNorm."""

from __future__ import annotations

import torch
from torch import nn

from dsv3serve.kernels.fp8_quant import HAS_TRITON
from dsv3serve.kernels.norm_quant import add_rmsnorm_quant_triton, rms_norm_ref


def norm_kernel_applies(weight: torch.Tensor) -> bool:
    """Whether the one-kernel RMSNorm runs for ``weight``: Triton installed and the weight
    bf16 on a CUDA device."""
    return HAS_TRITON and weight.is_cuda and weight.dtype == torch.bfloat16


class RMSNorm(nn.Module):
    """RMSNorm computed in float32, returned in the input dtype (weight applied after the cast).

    After :meth:`plan_fusion` switches it on, a bf16 norm on a CUDA device runs as one Triton
    kernel (:func:`~dsv3serve.kernels.norm_quant.add_rmsnorm_quant_triton` with neither a
    residual nor the quantisation) instead of the reference's eight torch ops; its bounds
    against the reference are the fused norm's (tests/support/norm_quant_cases.py). A
    strided input (a split's view) keeps the reference ops.
    """

    def __init__(self, dim: int, eps: float = 1e-6, dtype: torch.dtype = torch.bfloat16) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype), requires_grad=False)
        self.fused = False  # decided by plan_fusion, once the weight is on its device

    def plan_fusion(self, switch: bool) -> None:
        """Run the Triton kernel where ``switch`` is on and :func:`norm_kernel_applies`
        (call again after moving the weight)."""
        self.fused = switch and norm_kernel_applies(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused and x.dim() == 2 and x.is_contiguous():
            out = add_rmsnorm_quant_triton(x, None, self.weight, self.eps, True, False)
            assert out.normed is not None
            return out.normed
        return rms_norm_ref(x, self.weight, self.eps)
