"""Scaling a bench model's per-layer numbers to DeepSeek-V3's depth (61 layers)."""

from __future__ import annotations

import statistics

from dsv3serve.config import ModelConfig
from dsv3serve.model.presets import DEEPSEEK_V3_CONFIG

FULL_DENSE_LAYERS: int = DEEPSEEK_V3_CONFIG["first_k_dense_replace"]  # 3
FULL_MOE_LAYERS: int = DEEPSEEK_V3_CONFIG["num_hidden_layers"] - FULL_DENSE_LAYERS  # 58


def _layer_index(part: str) -> int | None:
    return int(part[len("layer") :]) if part.startswith("layer") else None


def project_full_depth(parts: dict[str, float], cfg: ModelConfig) -> float:
    """``parts`` (ms or bytes by part: ``layer{i}`` and the rest) with the layers replaced by
    3 x the mean dense layer + 58 x the mean MoE layer; the other parts are kept as measured."""
    dense, moe, other = [], [], 0.0
    for part, value in parts.items():
        index = _layer_index(part)
        if index is None:
            other += value
        else:
            (moe if cfg.is_moe_layer(index) else dense).append(value)
    if not dense or not moe:
        raise ValueError(f"expected dense and MoE layers among the parts, got {sorted(parts)}")
    return (
        other + FULL_DENSE_LAYERS * statistics.mean(dense) + FULL_MOE_LAYERS * statistics.mean(moe)
    )
