"""Rotary position embedding with DeepSeek's YaRN scaling.

DeepSeek rotates the 64-wide rope part in interleaved pairs ``(x0, x1), (x2, x3), ...``;
the rotated pairs stay in place, so cached keys keep the checkpoint's layout.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from dsv3serve.config import YarnScaling
from dsv3serve.kernels.rope_kv import rope_ref


def _correction_dim(rotations: float, dim: int, base: float, max_pos: int) -> float:
    return dim * math.log(max_pos / (rotations * 2 * math.pi)) / (2 * math.log(base))


def yarn_inv_freq(dim: int, base: float, yarn: YarnScaling | None) -> torch.Tensor:
    """Inverse frequencies [dim/2] (float32); YaRN blends interpolation and extrapolation."""
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    extrapolation = 1.0 / pos_freqs
    if yarn is None:
        return extrapolation
    interpolation = 1.0 / (yarn.factor * pos_freqs)
    orig = yarn.original_max_position_embeddings
    low = max(math.floor(_correction_dim(yarn.beta_fast, dim, base, orig)), 0)
    high: float = min(math.ceil(_correction_dim(yarn.beta_slow, dim, base, orig)), dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation_weight = 1.0 - ramp
    return interpolation * (1 - extrapolation_weight) + extrapolation * extrapolation_weight


class RotaryEmbedding(nn.Module):
    """Applies interleaved-pair rotary embedding to ``q_pe`` [T, H, D] and ``k_pe`` [T, D]."""

    inv_freq: torch.Tensor  # [D/2] float32, a non-persistent buffer

    def __init__(self, dim: int, base: float, yarn: YarnScaling | None) -> None:
        super().__init__()
        self.register_buffer("inv_freq", yarn_inv_freq(dim, base, yarn), persistent=False)
        self.scale = yarn.cos_sin_scale() if yarn is not None else 1.0

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [T, D/2] in float32 for integer ``positions`` [T]."""
        freqs = positions.float()[:, None] * self.inv_freq.to(positions.device)[None, :]
        return freqs.cos() * self.scale, freqs.sin() * self.scale

    @staticmethod
    def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate pairs of ``x`` [T, ..., D]; cos/sin [T, D/2] broadcast over middle dims."""
        return rope_ref(x, cos, sin)
