"""Checkpoint loading: sharded and single-file, bad checkpoints, dummy weights."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from model_utils import load_ours, make_attn, prefill_logits
from safetensors.torch import load_file, save_file

from dsv3serve.config import ModelConfig
from dsv3serve.model import weights
from dsv3serve.model.deepseek_v3 import DeepseekV3ForCausalLM, ModelOptions
from dsv3serve.model.tiny import FP8_QUANT_CONFIG, TINY_CONFIG, make_tiny_checkpoint
from dsv3serve.model.weights import WeightLoadError, load_checkpoint, load_weights

SMALL = {"vocab_size": 512}  # loader tests do not need the real vocabulary


@pytest.fixture(scope="module")
def single_file_dir(tmp_path_factory) -> Path:
    return make_tiny_checkpoint(
        tmp_path_factory.mktemp("one"), fp8=True, num_shards=1, overrides=SMALL
    )


def _corrupt(src: Path, dst: Path, edit) -> Path:
    dst.mkdir()
    tensors = load_file(str(src / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(dst / "model.safetensors"))
    (dst / "config.json").write_text((src / "config.json").read_text())
    return dst


def test_sharded_and_single_file_load_the_same(tmp_path, single_file_dir) -> None:
    sharded = make_tiny_checkpoint(tmp_path / "sharded", fp8=True, num_shards=3, overrides=SMALL)
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) == 3
    a, b = load_ours(sharded), load_ours(single_file_dir)
    for (name, p), q in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        assert torch.equal(p.float(), q.float()), name


def test_wrong_shape_names_tensor_and_both_shapes(tmp_path, single_file_dir) -> None:
    name = "model.layers.0.self_attn.kv_a_proj_with_mqa.weight"

    def edit(t):
        t[name] = t[name][:-1]

    bad = _corrupt(single_file_dir, tmp_path / "bad", edit)
    with pytest.raises(
        WeightLoadError, match=r"expected shape \[80, 256\] for " + name + r", got \[79, 256\]"
    ):
        load_ours(bad)


def test_missing_and_unexpected_tensors_are_named(tmp_path, single_file_dir) -> None:
    gone = "model.layers.2.mlp.experts.5.down_proj.weight_scale_inv"

    def edit(t):
        del t[gone]
        t["model.layers.2.mlp.extra.weight"] = torch.zeros(2)

    bad = _corrupt(single_file_dir, tmp_path / "bad", edit)
    with pytest.raises(WeightLoadError) as err:
        load_ours(bad)
    assert gone in str(err.value) and "model.layers.2.mlp.extra.weight" in str(err.value)


def test_expert_tensors_land_in_the_right_stack_slot(single_file_dir) -> None:
    model = load_ours(single_file_dir)
    t = load_file(str(single_file_dir / "model.safetensors"))
    experts = model.layers[3].mlp.experts
    inter = model.cfg.moe_intermediate_size
    up = t["model.layers.3.mlp.experts.11.up_proj.weight"]
    assert torch.equal(experts.w13[11, inter:].float(), up.float())
    down_s = t["model.layers.3.mlp.experts.11.down_proj.weight_scale_inv"]
    assert torch.equal(experts.w2_scale_inv[11], down_s)


def test_dummy_load_format_needs_no_files() -> None:
    cfg = ModelConfig.from_dict({**TINY_CONFIG, **SMALL, "quantization_config": FP8_QUANT_CONFIG})
    model = DeepseekV3ForCausalLM(cfg, ModelOptions(dtype=torch.float32))
    load_weights(model, None, load_format="dummy")
    assert model.layers[1].mlp.experts.w13.dtype == torch.float8_e4m3fn
    logits = prefill_logits(model, make_attn(model), [[1, 2, 3]])[0]
    assert torch.isfinite(logits).all() and logits.std() > 0


def test_model_dir_required_for_real_loads() -> None:
    model = DeepseekV3ForCausalLM(ModelConfig.from_dict({**TINY_CONFIG, **SMALL}))
    with pytest.raises(WeightLoadError, match="model directory is required"):
        load_weights(model, None)
    with pytest.raises(WeightLoadError, match="no \\*.safetensors"):
        load_checkpoint(model, Path("/nonexistent-dir-for-test"))


def test_fill_randn_fills_fp8_in_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(weights, "DUMMY_CHUNK_ELEMENTS", 7)  # many chunks, one partial
    t = torch.zeros(5, 200, dtype=torch.float8_e4m3fn)
    weights.fill_randn_(t, torch.Generator().manual_seed(0))
    values = t.float()
    assert torch.isfinite(values).all()
    assert (values != 0).float().mean() > 0.9  # every chunk written, the last one too
    assert 0.8 < values.std() < 1.2
