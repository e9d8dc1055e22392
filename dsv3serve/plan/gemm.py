"""The dense FP8 GEMMs one rank runs and which backend takes each, by M: for ``dsv3serve
plan`` and the engine's startup log.

Shapes come from the checkpoint's spec through the shard rule (``placement_of``), as the
memory plan's do: one dense layer's and one MoE layer's projections, q_a and kv_a packed as
the model packs them (``MLAttention.post_load``). The shared expert's linears run as GEMMs
only when it is not fused into the MoE (``--shared-experts-fusion``).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from dsv3serve.config import ModelConfig
from dsv3serve.json_types import JSONObject
from dsv3serve.kernels.gemm_routes import Range, backend_ranges, route_lines, table_note
from dsv3serve.kernels.gemm_table import (
    CONFIG_DIR,
    DeepGemmTable,
    load_table,
    normalize_device_name,
)
from dsv3serve.model.tiny import checkpoint_shapes, is_quantized
from dsv3serve.parallel.shard import RankLayout, placement_of

_ATTN = ("q_proj", "q_b_proj", "kv_b_proj", "o_proj")
ASSUMED = "DeepGEMM runs where the table wins if it passes its self-check"
_MLP = ("gate_proj", "up_proj", "down_proj")


def _local(cfg: ModelConfig, shapes: dict, name: str, layout: RankLayout | None) -> tuple[int, int]:
    full = shapes[f"{name}.weight"]
    if layout is None:
        return full
    n, k = placement_of(f"{name}.weight", layout, cfg.n_routed_experts).local_shape(full)
    return n, k


def dense_gemm_shapes(cfg: ModelConfig, layout: RankLayout | None) -> dict[str, tuple[int, int]]:
    """``{"self_attn.qkv_a_proj": (N, K), ...}``: the FP8 linears of a dense and a MoE layer
    on ``layout``'s rank (whole linears when None), one entry per name; empty for a bf16
    checkpoint or one without ``q_lora_rank`` (not DeepSeek-V3's attention)."""
    if cfg.quant_method != "fp8" or cfg.q_lora_rank is None:
        return {}
    shapes = checkpoint_shapes(dataclasses.asdict(cfg))
    layers = {0, min(cfg.first_k_dense_replace, cfg.num_hidden_layers - 1)}
    out: dict[str, tuple[int, int]] = {}
    for i in sorted(layers):
        base = f"model.layers.{i}"
        names = [f"self_attn.{p}" for p in _ATTN] + [f"mlp.{p}" for p in _MLP]
        names += [f"mlp.shared_experts.{p}" for p in _MLP]
        qa, kva = f"{base}.self_attn.q_a_proj", f"{base}.self_attn.kv_a_proj_with_mqa"
        if f"{qa}.weight" in shapes and f"{kva}.weight" in shapes:
            (n_q, k), (n_kv, _) = _local(cfg, shapes, qa, layout), _local(cfg, shapes, kva, layout)
            out["self_attn.qkv_a_proj"] = (n_q + n_kv, k)
        for name in names:
            full = f"{base}.{name}"
            if f"{full}.weight" in shapes and is_quantized(f"{full}.weight"):
                out.setdefault(name, _local(cfg, shapes, full, layout))
    return out


def gemm_json(
    cfg: ModelConfig,
    layout: RankLayout | None,
    max_m: int,
    device: str | None,
    table: DeepGemmTable | None,
) -> JSONObject:
    """:func:`gemm_report` as data (DeepGEMM assumed to pass its self-check)."""
    shapes = dense_gemm_shapes(cfg, layout)
    return {
        "device": device,
        "deepgemm_table": table is not None,
        "linears": {
            name: {"N": n, "K": k, "ranges": _ranges_json(n, k, max_m, table)}
            for name, (n, k) in shapes.items()
        },
    }


def _ranges_json(n: int, k: int, max_m: int, table: DeepGemmTable | None) -> list[JSONObject]:
    ranges: list[Range] = backend_ranges(n, k, max_m, table, table is not None)
    return [{"first_m": lo, "last_m": hi, "backend": b} for lo, hi, b in ranges]


def device_table(device: str | None, config_dir: Path = CONFIG_DIR) -> DeepGemmTable | None:
    """The shipped table of a GPU named as torch names it (None: no GPU named, or none)."""
    return load_table(device, config_dir) if device is not None else None


def gemm_report(
    cfg: ModelConfig,
    layout: RankLayout | None,
    max_m: int,
    device: str | None,
    table: DeepGemmTable | None,
    deepgemm: tuple[bool, str] | None = None,
) -> list[str]:
    """The header and one line per linear; ``device`` a GPU name (None: no table consulted);
    ``deepgemm``: (usable, verdict) of the self-check where it ran (None: assumed to pass)."""
    usable, note = deepgemm or (True, ASSUMED)
    name = normalize_device_name(device) if device is not None else None
    lines = [table_note(name, table, note)]
    shapes = dense_gemm_shapes(cfg, layout)
    return lines + ["  " + s for s in route_lines(shapes, max_m, table, usable and bool(table))]
