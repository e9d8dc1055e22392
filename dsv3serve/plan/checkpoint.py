"""The checkpoint's tensors as the planner sees them, from the config alone (names, full
shapes and dtypes written from the published spec by
:func:`~dsv3serve.model.tiny.checkpoint_shapes`, no file read), and the table row (kind) each
one's bytes count under."""

from __future__ import annotations

import dataclasses
import re

from dsv3serve.config import ModelConfig
from dsv3serve.model.tiny import checkpoint_shapes, is_quantized
from dsv3serve.parallel.shard_tensors import SCALE_SUFFIX, TensorInfo

__all__ = ["KINDS", "checkpoint_infos", "kind_of", "nextn_shared_names"]

KINDS = (
    "attention",
    "dense_mlp",
    "routed_experts",
    "shared_expert",
    "embedding",
    "lm_head",
    "nextn",
)
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def checkpoint_infos(cfg: ModelConfig) -> dict[str, TensorInfo]:
    """Every tensor of the model's checkpoint with full shape and dtype, no file needed:
    FP8 e4m3 projections with a float32 ``weight_scale_inv`` per block, bf16 elsewhere,
    float32 ``e_score_correction_bias``."""
    if cfg.q_lora_rank is None:
        raise ValueError("the planner needs q_lora_rank (DeepSeek-V3/R1), found None")
    block = cfg.weight_block_size if cfg.quant_method == "fp8" else None
    infos: dict[str, TensorInfo] = {}
    for name, shape in checkpoint_shapes(dataclasses.asdict(cfg)).items():
        if name.endswith("e_score_correction_bias"):
            infos[name] = TensorInfo(shape, "F32")
        elif block is not None and is_quantized(name):
            infos[name] = TensorInfo(shape, "F8_E4M3")
            blocks = tuple(-(-size // b) for size, b in zip(shape, block, strict=True))
            infos[f"{name}{SCALE_SUFFIX}"] = TensorInfo(blocks, "F32")
        else:
            infos[name] = TensorInfo(shape, "BF16")
    return infos


def nextn_shared_names(cfg: ModelConfig) -> tuple[str, ...]:
    """The NextN layer's copies of embedding and head: the model shares the main ones and
    does not load these (``DeepseekV3ForCausalLM.ignored_checkpoint_names``)."""
    if not cfg.num_nextn_predict_layers:
        return ()
    mtp = f"model.layers.{cfg.num_hidden_layers}"
    return (f"{mtp}.embed_tokens.", f"{mtp}.shared_head.head.")


def kind_of(name: str, num_hidden_layers: int) -> str:
    """The table row of a checkpoint tensor (norms and the router gate go with their kind)."""
    m = _LAYER.match(name)
    if m and int(m.group(1)) >= num_hidden_layers:
        return "nextn"
    if name.startswith("model.embed_tokens."):
        return "embedding"
    if name.startswith(("lm_head.", "model.norm.")):
        return "lm_head"
    if ".mlp.shared_experts." in name:
        return "shared_expert"
    if ".mlp.experts." in name or ".mlp.gate." in name:
        return "routed_experts"
    return "dense_mlp" if ".mlp." in name else "attention"
