"""CPU checks of the FP8-vs-dequantised comparison harness (``tests/support/fp8_compare.py``).

A reduced-width DeepSeek-V3 of the bench model's structure (one dense, one MoE layer, the
real head dims, 16 experts top-8 in 8 groups) in float32 on the torch backends:

- :func:`dequantize_model_` gives every e4m3 tensor's real values (checked against
  :func:`dequant_weight_block` on the fast model's own tensors) and leaves no e4m3 behind;
- FP8 weights *without* activation quantisation match the dequantised model to float32
  rounding, so the harness itself (slots, teacher forcing, row collection) adds no error;
- with activation quantisation the error is that of e4m3 activations (a few percent, see
  ``CPU_BOUND``) and not zero, so the comparison sees the quantisation;
- a wrong reference weight is caught far above the bound.
"""

from __future__ import annotations

import pytest
import torch
from fp8_compare import compare, kv_tokens_needed, make_reference, make_runner

from dsv3serve.config import ModelConfig
from dsv3serve.engine.model_runner import ModelRunner
from dsv3serve.kernels.fp8_ref import FP8_DTYPE, dequant_weight_block
from dsv3serve.layers.linear import Linear
from dsv3serve.model.presets import DEEPSEEK_V3_CONFIG
from dsv3serve.moe.experts import FusedExperts

REDUCED = {
    "hidden_size": 512,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "q_lora_rank": 256,
    "intermediate_size": 1024,
    "moe_intermediate_size": 128,
    "n_routed_experts": 16,
    "vocab_size": 2048,
    "num_hidden_layers": 2,
    "first_k_dense_replace": 1,
    "num_nextn_predict_layers": 0,
}
DECODE_STEPS = 3
# Measured 0.059 (prefill) / 0.063 (decode) at this width; twice that leaves headroom for
# other seeds without hiding a broken path (a wrong weight gives > 3x that below).
CPU_BOUND = 0.12
EXACT_BOUND = 1e-5  # float32 rounding of the same real weights, summed in another order


@pytest.fixture(scope="module")
def cfg() -> ModelConfig:
    return ModelConfig.from_dict({**DEEPSEEK_V3_CONFIG, **REDUCED})


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [
        torch.randint(2, REDUCED["vocab_size"], (n,), generator=g).tolist() for n in (32, 17, 39)
    ]


def _pair(cfg: ModelConfig, prompts: list[list[int]], act_quant: bool) -> tuple[ModelRunner, ...]:
    tokens = kv_tokens_needed(prompts, DECODE_STEPS)
    fast = make_runner(cfg, "cpu", "torch", "torch", act_quant, tokens)
    return fast, make_reference(fast, tokens)


def _fp8_pairs(runner: ModelRunner) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Every e4m3 tensor of the model with its block scales, by parameter name."""
    params = dict(runner.model.named_parameters())
    return {
        name: (p, params[name.replace("weight", "weight_scale_inv") if name.endswith("weight")
                         else f"{name}_scale_inv"])
        for name, p in params.items()
        if p.dtype == FP8_DTYPE
    }  # fmt: skip


def test_dequantize_model_gives_real_weights(cfg: ModelConfig, prompts: list[list[int]]) -> None:
    fast, ref = _pair(cfg, prompts, act_quant=True)
    pairs = _fp8_pairs(fast)
    ref_params = dict(ref.model.named_parameters())
    assert pairs, "the fast model holds no e4m3 weights"
    assert not any(p.dtype == FP8_DTYPE for p in ref_params.values())
    assert not any(n.endswith("scale_inv") for n in ref_params)
    for name, (w, s) in pairs.items():
        matrices = zip(w.view(-1, *w.shape[-2:]), s.view(-1, *s.shape[-2:]), strict=True)
        expected = torch.stack([dequant_weight_block(m, sc) for m, sc in matrices])
        torch.testing.assert_close(ref_params[name].view_as(expected), expected, rtol=0, atol=0)
    linears = [m for m in ref.model.modules() if isinstance(m, Linear)]
    assert not any(lin.act_quant or lin.is_fp8 for lin in linears)
    assert not any(m.is_fp8 for m in ref.model.modules() if isinstance(m, FusedExperts))


def test_fp8_weights_without_act_quant_match_exactly(
    cfg: ModelConfig, prompts: list[list[int]]
) -> None:
    fast, ref = _pair(cfg, prompts, act_quant=False)
    result = compare(fast, ref, prompts, DECODE_STEPS)
    for phase in ("prefill", "decode"):
        stats = result.stats(phase)
        print(f"\nfp8 weights, no act quant, {phase}: {stats}")
        assert stats["rel_err"] < EXACT_BOUND, stats


def test_act_quant_error_is_bounded_and_visible(cfg: ModelConfig, prompts: list[list[int]]) -> None:
    fast, ref = _pair(cfg, prompts, act_quant=True)
    result = compare(fast, ref, prompts, DECODE_STEPS)
    rows = {"prefill": sum(map(len, prompts)), "decode": DECODE_STEPS * len(prompts)}
    for phase in ("prefill", "decode"):
        stats = result.stats(phase)
        print(f"\nfp8 + act quant vs dequantised, {phase}: {stats}")
        assert stats["rows"] == rows[phase]
        assert stats["finite"] == 1.0
        assert 0.005 < stats["rel_err"] < CPU_BOUND, stats
        assert stats["ref_row_std"] > 0.1, "degenerate reference logits"


def test_wrong_reference_weight_is_caught(cfg: ModelConfig, prompts: list[list[int]]) -> None:
    fast, ref = _pair(cfg, prompts, act_quant=False)
    ref.model.layers[0].mlp.down_proj.weight.data.neg_()  # the dense MLP's output flipped
    stats = compare(fast, ref, prompts, DECODE_STEPS).stats("prefill")
    print(f"\nreference with a negated dense down_proj, prefill: {stats}")
    assert stats["rel_err"] > 3 * CPU_BOUND, stats
