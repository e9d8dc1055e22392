"""Model configuration read from a DeepSeek-V3/R1 ``config.json``.

Two spellings of the same checkpoint config are accepted:

* the published checkpoints' form: ``rope_scaling``, ``rope_theta``, ``topk_method``,
  ``scoring_func``;
* the form ``transformers`` 5 writes with ``save_pretrained``: ``rope_parameters``
  (holding ``rope_theta`` and the YaRN fields), ``rope_interleave``, no ``topk_method``.

Values the runtime cannot execute are rejected once here, naming the field, the value
found and the values supported.
"""

from __future__ import annotations

import json
import math
from dataclasses import MISSING, dataclass, fields
from pathlib import Path
from typing import Any

from dsv3serve.json_types import JSONObject, JSONValue, json_float, json_int, json_object


class ConfigError(ValueError):
    """A config.json field holds a value this runtime does not support."""


def _unsupported(field: str, found: object, supported: object) -> ConfigError:
    return ConfigError(f"config field {field!r}: found {found!r}, supported: {supported!r}")


def _only(raw: JSONObject, field: str, supported: str, prefix: str = "") -> str:
    """``raw[field]``, ``supported`` where absent; ConfigError if it is anything else."""
    found = raw.get(field, supported)
    if found != supported:
        raise _unsupported(prefix + field, found, [supported])
    return supported


class MLAHeadShape:
    """The widths an MLA head derives from its ranks (ModelConfig and a rank's MLADims)."""

    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def kv_cache_dim(self) -> int:
        """Width of one cached token per layer: latent + rope part (576 for V3)."""
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass(frozen=True)
class YarnScaling:
    """YaRN rope scaling parameters (DeepSeek-V3: factor 40 over 4096 positions)."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0

    def softmax_mscale(self) -> float:
        """Multiplier DeepSeek applies to the softmax scale: ``yarn_mscale(mscale_all_dim)**2``."""
        if not self.mscale_all_dim or self.factor <= 1:
            return 1.0
        m = 0.1 * self.mscale_all_dim * math.log(self.factor) + 1.0
        return m * m

    def cos_sin_scale(self) -> float:
        """Scale applied to cos/sin: ``yarn_mscale(mscale) / yarn_mscale(mscale_all_dim)``."""

        def m(scale: float, ms: float) -> float:
            return 1.0 if scale <= 1 else 0.1 * ms * math.log(scale) + 1.0

        if self.mscale and self.mscale_all_dim:
            return m(self.factor, self.mscale) / m(self.factor, self.mscale_all_dim)
        return m(self.factor, 1.0)


@dataclass(frozen=True, kw_only=True)
class ModelConfig(MLAHeadShape):
    """The checkpoint's architecture, with DeepSeek-V3's field names."""

    # copied from config.json as they are (a field with a default may be left out there)
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    q_lora_rank: int | None = None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    intermediate_size: int
    moe_intermediate_size: int
    first_k_dense_replace: int = 0
    n_routed_experts: int
    n_shared_experts: int = 1
    num_experts_per_tok: int
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    rope_interleave: bool = True
    rms_norm_eps: float = 1e-6
    vocab_size: int
    max_position_embeddings: int = 4096
    num_nextn_predict_layers: int = 0
    tie_word_embeddings: bool = False
    # checked, parsed or normalised by from_dict
    topk_method: str
    scoring_func: str
    routed_scaling_factor: float
    rope_theta: float
    rope_scaling: YarnScaling | None
    quant_method: str | None  # "fp8" or None (bf16 checkpoint)
    weight_block_size: tuple[int, int] | None
    bos_token_id: int
    eos_token_id: int

    @property
    def softmax_scale(self) -> float:
        scale = self.qk_head_dim**-0.5
        if self.rope_scaling is not None:
            scale *= self.rope_scaling.softmax_mscale()
        return scale

    def is_moe_layer(self, layer_id: int) -> bool:
        return layer_id >= self.first_k_dense_replace

    @classmethod
    def from_hf(cls, path: str | Path) -> ModelConfig:
        """Read ``config.json`` from a checkpoint directory (or the file itself)."""
        p = Path(path)
        file = p / "config.json" if p.is_dir() else p
        return cls.from_dict(json.loads(file.read_text()))

    @classmethod
    def from_dict(cls, raw: JSONObject) -> ModelConfig:
        """Validate and normalise a raw config dict (either spelling)."""
        _check_model_type(raw)
        theta, yarn = _parse_rope(raw)
        qc = raw.get("quantization_config")
        quant, block = _parse_quant(None if qc is None else json_object(qc, "quantization_config"))
        scoring = _only(raw, "scoring_func", "sigmoid")
        topk_method = _only(raw, "topk_method", "noaux_tc")
        # JSON values, as config.json has them; _check_shapes checks what the model relies on
        parsed: dict[str, Any] = {
            "topk_method": topk_method,
            "scoring_func": scoring,
            "routed_scaling_factor": json_float(
                raw.get("routed_scaling_factor", 1.0), "routed_scaling_factor"
            ),
            "rope_theta": theta,
            "rope_scaling": yarn,
            "quant_method": quant,
            "weight_block_size": block,
            "bos_token_id": _first_id(raw.get("bos_token_id"), 0),
            "eos_token_id": _first_id(raw.get("eos_token_id"), 1),
        }
        copied: dict[str, Any] = {
            f.name: raw[f.name] if f.default is MISSING else raw.get(f.name, f.default)
            for f in fields(cls)
            if f.name not in parsed
        }
        cfg = cls(**copied, **parsed)
        _check_shapes(cfg)
        return cfg


def _first_id(value: JSONValue, default: int) -> int:
    if value is None:
        return default
    first = value[0] if isinstance(value, list) else value
    return json_int(first, "token id")


def _check_model_type(raw: JSONObject) -> None:
    _only(raw, "model_type", "deepseek_v3")
    _only(raw, "hidden_act", "silu")
    if raw.get("attention_bias", False):
        raise _unsupported("attention_bias", True, [False])


def _parse_rope(raw: JSONObject) -> tuple[float, YarnScaling | None]:
    """Return (rope_theta, YaRN params) from ``rope_scaling`` or ``rope_parameters``."""
    params = raw.get("rope_parameters")
    found = params if params is not None else raw.get("rope_scaling")
    field = "rope_parameters" if params is not None else "rope_scaling"
    own = json_object(params, field) if params else {}
    theta = json_float(own.get("rope_theta", raw.get("rope_theta", 10000.0)), "rope_theta")
    if not found:
        return theta, None
    scaling = json_object(found, field)
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return theta, None
    if rope_type != "yarn":
        raise _unsupported(f"{field}.rope_type", rope_type, ["yarn", "default"])
    yarn = YarnScaling(
        factor=json_float(scaling["factor"], f"{field}.factor"),
        original_max_position_embeddings=int(
            json_float(
                scaling["original_max_position_embeddings"],
                f"{field}.original_max_position_embeddings",
            )
        ),
        beta_fast=json_float(scaling.get("beta_fast") or 32.0, f"{field}.beta_fast"),
        beta_slow=json_float(scaling.get("beta_slow") or 1.0, f"{field}.beta_slow"),
        mscale=json_float(scaling.get("mscale") or 0.0, f"{field}.mscale"),
        mscale_all_dim=json_float(scaling.get("mscale_all_dim") or 0.0, f"{field}.mscale_all_dim"),
    )
    return theta, yarn


def _parse_quant(qc: JSONObject | None) -> tuple[str | None, tuple[int, int] | None]:
    if not qc:
        return None, None
    method = qc.get("quant_method")
    if method != "fp8":
        raise _unsupported("quantization_config.quant_method", method, ["fp8"])
    _only(qc, "fmt", "e4m3", "quantization_config.")
    block = qc.get("weight_block_size")
    if not isinstance(block, (list, tuple)) or list(block) != [128, 128]:
        raise _unsupported("quantization_config.weight_block_size", block, [[128, 128]])
    return "fp8", (128, 128)


def _check_shapes(cfg: ModelConfig) -> None:
    if cfg.n_routed_experts % cfg.n_group:
        raise _unsupported(
            "n_group", cfg.n_group, f"a divisor of n_routed_experts={cfg.n_routed_experts}"
        )
    if not 0 < cfg.topk_group <= cfg.n_group:
        raise _unsupported("topk_group", cfg.topk_group, f"1..n_group={cfg.n_group}")
    per_group = cfg.n_routed_experts // cfg.n_group
    if cfg.num_experts_per_tok > cfg.topk_group * per_group:
        raise _unsupported(
            "num_experts_per_tok",
            cfg.num_experts_per_tok,
            f"at most topk_group * experts per group = {cfg.topk_group * per_group}",
        )
    if cfg.qk_rope_head_dim % 2:
        raise _unsupported("qk_rope_head_dim", cfg.qk_rope_head_dim, "an even number")
    if cfg.num_nextn_predict_layers not in (0, 1):
        raise _unsupported("num_nextn_predict_layers", cfg.num_nextn_predict_layers, [0, 1])
