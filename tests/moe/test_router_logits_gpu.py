"""The MoE router logits on a GPU: one bf16 GEMM writing float32 (where the layer planned
it: CUDA, bf16) against the reference casts of ``x`` and the router weight to float32, at
DeepSeek-V3's widths. Both multiply bf16 values exactly in float32 and accumulate in
float32, so they differ only in summation order: relative 1e-5 of the row's magnitude."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from fresh_seed import session_seed

from dsv3serve.config import ModelConfig
from dsv3serve.model.deepseek_v3 import ModelOptions, MoE
from dsv3serve.model.presets import DEEPSEEK_V3_CONFIG

pytestmark = pytest.mark.gpu
SEED = session_seed()


@pytest.mark.parametrize("t", [1, 64])
def test_router_logits_gemm_equals_casts(t: int) -> None:
    cfg = ModelConfig.from_dict(DEEPSEEK_V3_CONFIG)
    with torch.device("meta"):
        moe = MoE(cfg, "model.layers.3.mlp", ModelOptions(moe_backend="torch"))
    g = torch.Generator(device="cuda").manual_seed(SEED)
    weight = torch.randn(cfg.n_routed_experts, cfg.hidden_size, device="cuda", generator=g)
    moe.gate.weight = torch.nn.Parameter(weight.to(torch.bfloat16), requires_grad=False)
    x = torch.randn(t, cfg.hidden_size, device="cuda", generator=g).to(torch.bfloat16)
    moe.plan_fusion(x.device, x.dtype)
    assert moe.logits_in_gemm
    got = moe.router_logits(x)
    ref = F.linear(x.float(), moe.gate.weight.float())
    assert got.dtype == torch.float32 and got.shape == ref.shape
    scale = F.linear(x.float().abs(), moe.gate.weight.float().abs())
    worst = ((got - ref).abs() / (scale * 1e-5)).max().item()
    assert worst <= 1.0, f"expected logits within 1e-5 of |x| @ |W|.T, got {worst:.2f}x"
