"""ModelConfig.from_hf on the published config form, the transformers-5 form, and bad values."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dsv3serve.config import ConfigError, ModelConfig
from dsv3serve.model.presets import DEEPSEEK_V3_CONFIG

PUBLISHED_V3 = DEEPSEEK_V3_CONFIG


def test_published_form() -> None:
    cfg = ModelConfig.from_dict(PUBLISHED_V3)
    assert cfg.kv_cache_dim == 576
    assert cfg.qk_head_dim == 192
    assert cfg.quant_method == "fp8" and cfg.weight_block_size == (128, 128)
    assert cfg.rope_scaling is not None and cfg.rope_scaling.factor == 40
    # softmax scale = 192**-0.5 * (0.1 * ln(40) + 1)**2
    assert cfg.softmax_scale == pytest.approx(192**-0.5 * (0.1 * 3.6888794541 + 1) ** 2)
    assert [cfg.is_moe_layer(i) for i in (0, 2, 3, 60)] == [False, False, True, True]


def test_transformers5_form_written_by_save_pretrained(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    hf_cfg = transformers.DeepseekV3Config(
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 40.0,
            "original_max_position_embeddings": 4096,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
        max_position_embeddings=163840,
    )
    hf_cfg.save_pretrained(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    assert "topk_method" not in raw and "rope_parameters" in raw
    cfg = ModelConfig.from_hf(tmp_path)
    published = ModelConfig.from_dict({**PUBLISHED_V3, "quantization_config": None})
    for field in (
        "hidden_size",
        "n_routed_experts",
        "kv_lora_rank",
        "rope_theta",
        "rope_scaling",
        "rope_interleave",
        "topk_group",
        "softmax_scale",
    ):
        assert getattr(cfg, field) == getattr(published, field), field


@pytest.mark.parametrize(
    ("patch", "field", "found"),
    [
        ({"scoring_func": "softmax"}, "scoring_func", "softmax"),
        ({"topk_method": "greedy"}, "topk_method", "greedy"),
        (
            {
                "quantization_config": {
                    "quant_method": "fp8",
                    "fmt": "e4m3",
                    "weight_block_size": [64, 64],
                }
            },
            "quantization_config.weight_block_size",
            "[64, 64]",
        ),
        (
            {"quantization_config": {"quant_method": "awq"}},
            "quantization_config.quant_method",
            "awq",
        ),
        ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope_scaling.rope_type", "linear"),
        ({"n_group": 7}, "n_group", "7"),
    ],
)
def test_unsupported_values_are_rejected_with_field_value_and_choices(patch, field, found) -> None:
    with pytest.raises(ConfigError) as err:
        ModelConfig.from_dict({**PUBLISHED_V3, **patch})
    msg = str(err.value)
    assert repr(field) in msg and found in msg and "supported" in msg
