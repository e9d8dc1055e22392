"""RMSNorm."""

from __future__ import annotations

import torch
from torch import nn

from dsv3serve.kernels.norm_quant import rms_norm_ref


class RMSNorm(nn.Module):
    """RMSNorm computed in float32, returned in the input dtype (weight applied after the cast)."""

    def __init__(self, dim: int, eps: float = 1e-6, dtype: torch.dtype = torch.bfloat16) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm_ref(x, self.weight, self.eps)
