"""Scaling a bench model's per-layer numbers to DeepSeek-V3's depth (61 layers)."""

from __future__ import annotations

import statistics
from typing import Any

from dsv3serve.config import ModelConfig
from dsv3serve.model.presets import DEEPSEEK_V3_CONFIG

FULL_DENSE_LAYERS: int = DEEPSEEK_V3_CONFIG["first_k_dense_replace"]  # 3
FULL_MOE_LAYERS: int = DEEPSEEK_V3_CONFIG["num_hidden_layers"] - FULL_DENSE_LAYERS  # 58


def _layer_index(part: str) -> int | None:
    return int(part[len("layer") :]) if part.startswith("layer") else None


def project_full_depth(parts: dict[str, float], cfg: ModelConfig) -> float:
    """``parts`` (ms or bytes by part: ``layer{i}`` and the rest) with the layers replaced by
    3 x the mean dense layer + 58 x the mean MoE layer; the other parts are kept as measured."""
    dense: list[float] = []
    moe: list[float] = []
    other = 0.0
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


def add_full_depth_layers(
    measured_ms: float, dense_ms: float, moe_ms: float, cfg: ModelConfig
) -> float:
    """A step measured whole on the bench model ``cfg``, plus the layers DeepSeek-V3 has
    beyond it: ``measured + (58 - n_moe) * moe_ms + (3 - n_dense) * dense_ms``, with
    ``dense_ms`` / ``moe_ms`` one dense / MoE layer's time at the step's shape."""
    num_dense = cfg.first_k_dense_replace
    num_moe = cfg.num_hidden_layers - num_dense
    extra_moe, extra_dense = FULL_MOE_LAYERS - num_moe, FULL_DENSE_LAYERS - num_dense
    return measured_ms + extra_moe * moe_ms + extra_dense * dense_ms


def project_graph_costs(
    graph: dict[str, Any], layer_ms: dict[str, dict[str, float]], cfg: ModelConfig
) -> dict[str, Any]:
    """The graphed decode and verify steps of a ``bench model`` MTP row (``graph``:
    ``decode_ms``, ``verify_ms`` by k) at 61 layers, from the graphed layer times
    ``layer_ms[kind][tokens per sequence]`` (kind ``dense`` / ``moe``; 1 for decode,
    ``k + 1`` for verify k). Draft chain and extend (``chain_ms``, ``extend_ms``) are not
    scaled (one layer in the full model too): the projected row keeps the measured ones."""

    def full(ms: float, width: int) -> float:
        key = str(width)
        return add_full_depth_layers(ms, layer_ms["dense"][key], layer_ms["moe"][key], cfg)

    verify = {k: full(ms, int(k) + 1) for k, ms in graph["verify_ms"].items()}
    return {"decode_ms": full(graph["decode_ms"], 1), "verify_ms": verify}
