"""Named model configs usable without a checkpoint (with ``load_format="dummy"``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from dsv3serve.json_types import JSONObject
from dsv3serve.settings import Settings
from dsv3serve.tokenizer.files import write_tokenizer_files

# The published DeepSeek-V3 config.json (facts of the released checkpoint).
DEEPSEEK_V3_CONFIG: dict[str, Any] = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 61,
    "num_attention_heads": 128,
    "num_key_value_heads": 128,
    "q_lora_rank": 1536,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "num_experts_per_tok": 8,
    "n_group": 8,
    "topk_group": 4,
    "topk_method": "noaux_tc",
    "scoring_func": "sigmoid",
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.5,
    "first_k_dense_replace": 3,
    "moe_layer_freq": 1,
    "ep_size": 1,
    "aux_loss_alpha": 0.001,
    "seq_aux": True,
    "hidden_act": "silu",
    "max_position_embeddings": 163840,
    "rms_norm_eps": 1e-06,
    "rope_theta": 10000,
    "vocab_size": 129280,
    "num_nextn_predict_layers": 1,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "tie_word_embeddings": False,
    "rope_scaling": {
        "beta_fast": 32,
        "beta_slow": 1,
        "factor": 40,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096,
        "type": "yarn",
    },
    "quantization_config": {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": [128, 128],
    },
}

PRESETS = {"deepseek-v3": DEEPSEEK_V3_CONFIG}


def preset_dir(name: str, overrides: JSONObject | None = None) -> Path:
    """A directory with the preset's config.json (+ overrides) and tokenizer, no weights."""
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; known: {sorted(PRESETS)}")
    config = {**PRESETS[name], **(overrides or {})}
    key = "-".join(f"{k}{v}" for k, v in sorted((overrides or {}).items()))
    root = Settings.from_env().cache_dir
    path = root / f"preset-{name}{'-' + key if key else ''}"
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    if not (path / "tokenizer.json").exists():
        write_tokenizer_files(path)
    return path
