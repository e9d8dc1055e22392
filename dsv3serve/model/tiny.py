"""Writes a tiny DeepSeek-V3-architecture checkpoint, in HF format, with no downloads.

The tensor names and layouts are those of the published checkpoints (written out here
from their specification, not derived from our model), so loading it exercises the real
name mapping. ``fp8=True`` stores linears as e4m3 with 128x128 ``weight_scale_inv``.
The tokenizer is the published DeepSeek-V3 one (vocab padded to 129,280).
"""

from __future__ import annotations

import json
import shutil
import tempfile
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from dsv3serve.json_types import JSONObject, json_int
from dsv3serve.kernels.fp8_ref import quant_weight_block
from dsv3serve.settings import Settings
from dsv3serve.tokenizer.files import write_tokenizer_files

TINY_CONFIG: dict[str, Any] = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "hidden_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "q_lora_rank": 96,
    "kv_lora_rank": 64,
    "qk_nope_head_dim": 32,
    "qk_rope_head_dim": 16,
    "v_head_dim": 32,
    "intermediate_size": 512,
    "moe_intermediate_size": 128,
    "first_k_dense_replace": 1,
    "n_routed_experts": 16,
    "n_shared_experts": 1,
    "num_experts_per_tok": 4,
    "n_group": 4,
    "topk_group": 2,
    "topk_method": "noaux_tc",
    "scoring_func": "sigmoid",
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.5,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000,
    "rope_scaling": {
        "type": "yarn",
        "factor": 40,
        "original_max_position_embeddings": 4096,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    },
    "max_position_embeddings": 163840,
    "vocab_size": 129280,
    "num_nextn_predict_layers": 1,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "torch_dtype": "bfloat16",
}

FP8_QUANT_CONFIG = {
    "activation_scheme": "dynamic",
    "fmt": "e4m3",
    "quant_method": "fp8",
    "weight_block_size": [128, 128],
}

GENERATION_CONFIG = {
    "bos_token_id": 0,
    "eos_token_id": 1,
    "do_sample": True,
    "temperature": 0.6,
    "top_p": 0.95,
}


@dataclass(frozen=True)
class _Dims:
    """The ``config.json`` integers the tensor shapes follow, read by name."""

    hidden_size: int
    num_attention_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    intermediate_size: int
    moe_intermediate_size: int
    first_k_dense_replace: int
    n_routed_experts: int
    n_shared_experts: int
    vocab_size: int
    num_hidden_layers: int
    num_nextn_predict_layers: int

    @classmethod
    def of(cls, c: JSONObject) -> _Dims:
        """Read from config ``c``; TypeError naming a field that is missing or not an int."""
        defaults: JSONObject = {"num_nextn_predict_layers": 0}
        names = [f.name for f in fields(cls)]
        return cls(**{n: json_int(c.get(n, defaults.get(n)), n) for n in names})


def _attn_shapes(d: _Dims, p: str) -> dict[str, tuple[int, ...]]:
    h, heads = d.hidden_size, d.num_attention_heads
    qk = d.qk_nope_head_dim + d.qk_rope_head_dim
    return {
        f"{p}.q_a_proj.weight": (d.q_lora_rank, h),
        f"{p}.q_a_layernorm.weight": (d.q_lora_rank,),
        f"{p}.q_b_proj.weight": (heads * qk, d.q_lora_rank),
        f"{p}.kv_a_proj_with_mqa.weight": (d.kv_lora_rank + d.qk_rope_head_dim, h),
        f"{p}.kv_a_layernorm.weight": (d.kv_lora_rank,),
        f"{p}.kv_b_proj.weight": (heads * (d.qk_nope_head_dim + d.v_head_dim), d.kv_lora_rank),
        f"{p}.o_proj.weight": (h, heads * d.v_head_dim),
    }


def _mlp_shapes(p: str, h: int, inter: int) -> dict[str, tuple[int, ...]]:
    return {
        f"{p}.gate_proj.weight": (inter, h),
        f"{p}.up_proj.weight": (inter, h),
        f"{p}.down_proj.weight": (h, inter),
    }


def _layer_shapes(d: _Dims, i: int) -> dict[str, tuple[int, ...]]:
    h, p = d.hidden_size, f"model.layers.{i}"
    shapes: dict[str, tuple[int, ...]] = {
        f"{p}.input_layernorm.weight": (h,),
        f"{p}.post_attention_layernorm.weight": (h,),
    }
    shapes.update(_attn_shapes(d, f"{p}.self_attn"))
    if i < d.first_k_dense_replace:
        shapes.update(_mlp_shapes(f"{p}.mlp", h, d.intermediate_size))
        return shapes
    e, inter = d.n_routed_experts, d.moe_intermediate_size
    shapes[f"{p}.mlp.gate.weight"] = (e, h)
    shapes[f"{p}.mlp.gate.e_score_correction_bias"] = (e,)
    for j in range(e):
        shapes.update(_mlp_shapes(f"{p}.mlp.experts.{j}", h, inter))
    shapes.update(_mlp_shapes(f"{p}.mlp.shared_experts", h, inter * d.n_shared_experts))
    return shapes


def checkpoint_shapes(c: JSONObject) -> dict[str, tuple[int, ...]]:
    """Every tensor of a DeepSeek-V3 checkpoint (before FP8 scales) with its shape."""
    d = _Dims.of(c)
    h, v, n = d.hidden_size, d.vocab_size, d.num_hidden_layers
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, h)}
    for i in range(n + d.num_nextn_predict_layers):
        shapes.update(_layer_shapes(d, i))
    if d.num_nextn_predict_layers:
        p = f"model.layers.{n}"
        shapes.update(
            {
                f"{p}.enorm.weight": (h,),
                f"{p}.hnorm.weight": (h,),
                f"{p}.eh_proj.weight": (h, 2 * h),
                f"{p}.embed_tokens.weight": (v, h),
                f"{p}.shared_head.norm.weight": (h,),
                f"{p}.shared_head.head.weight": (v, h),
            }
        )
    shapes["model.norm.weight"] = (h,)
    shapes["lm_head.weight"] = (v, h)
    return shapes


def is_quantized(name: str) -> bool:
    """FP8 in DeepSeek's checkpoints: every 2-D projection except router, eh_proj, heads."""
    bf16 = (
        "embed_tokens.weight",
        "lm_head.weight",
        "mlp.gate.weight",
        "eh_proj.weight",
        "shared_head.head.weight",
    )
    return name.endswith(("proj.weight", "proj_with_mqa.weight")) and not name.endswith(bf16)


def _random_tensor(name: str, shape: tuple[int, ...], g: torch.Generator) -> torch.Tensor:
    if name.endswith("norm.weight"):
        return 1.0 + 0.1 * torch.randn(shape, generator=g)
    if name.endswith("e_score_correction_bias"):
        return 0.5 * torch.randn(shape, generator=g)  # large enough to change routing
    if name.endswith("embed_tokens.weight"):
        return torch.randn(shape, generator=g)
    return torch.randn(shape, generator=g) * (shape[-1] ** -0.5)


def make_tensors(c: JSONObject, fp8: bool, seed: int) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors: bf16 (bias fp32), or e4m3 + block scales when ``fp8``."""
    g = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for name, shape in checkpoint_shapes(c).items():
        t = _random_tensor(name, shape, g)
        if name.endswith("e_score_correction_bias"):
            out[name] = t.float()
        elif fp8 and is_quantized(name):
            out[name], out[f"{name}_scale_inv"] = quant_weight_block(t)
        else:
            out[name] = t.to(torch.bfloat16)
    return out


def _layer_of(name: str) -> int:
    parts = name.split(".")
    return int(parts[2]) if name.startswith("model.layers.") else -1


def _write_shards(tensors: dict[str, torch.Tensor], out: Path, num_shards: int) -> None:
    """Write ``num_shards`` files plus ``model.safetensors.index.json`` (split by layer)."""
    layers = sorted({_layer_of(n) for n in tensors})
    per = -(-len(layers) // num_shards)
    shard_of = {layer: layers.index(layer) // per for layer in layers}
    names = [f"model-{i + 1:05d}-of-{num_shards:05d}.safetensors" for i in range(num_shards)]
    weight_map = {n: names[shard_of[_layer_of(n)]] for n in tensors}
    for i, fname in enumerate(names):
        part = {n: t.contiguous() for n, t in tensors.items() if weight_map[n] == names[i]}
        save_file(part, str(out / fname), metadata={"format": "pt"})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def make_tiny_checkpoint(
    out_dir: str | Path,
    fp8: bool = True,
    seed: int = 0,
    num_shards: int = 2,
    overrides: JSONObject | None = None,
) -> Path:
    """Write a complete tiny HF checkpoint directory and return its path.

    ``num_shards=1`` writes a single ``model.safetensors`` with no index.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = {**TINY_CONFIG, **(overrides or {})}
    if fp8:
        config["quantization_config"] = FP8_QUANT_CONFIG
    tensors = make_tensors(config, fp8, seed)
    if num_shards == 1:
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    else:
        _write_shards(tensors, out, num_shards)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    (out / "generation_config.json").write_text(json.dumps(GENERATION_CONFIG, indent=2))
    write_tokenizer_files(out)
    return out


def cached_tiny_checkpoint(fp8: bool = True, seed: int = 0) -> Path:
    """The tiny checkpoint in ``$DSV3SERVE_CACHE`` (default ~/.cache/dsv3serve), made once."""
    root = Settings.from_env().cache_dir
    path = root / f"tiny-{'fp8' if fp8 else 'bf16'}-seed{seed}-v1"
    if (path / "config.json").exists():
        return path
    root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=root, prefix=".staging-"))
    make_tiny_checkpoint(staging, fp8=fp8, seed=seed)
    try:
        staging.rename(path)  # atomic: concurrent makers race safely
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)
    return path
