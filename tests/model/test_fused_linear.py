"""Packing q_a_proj with kv_a_proj_with_mqa: same outputs as the separate GEMMs, no copy."""

from __future__ import annotations

import pytest
import torch

from dsv3serve.kernels.fp8_ref import quant_weight_block
from dsv3serve.layers.fused import can_pack, pack_rows
from dsv3serve.layers.linear import Linear


def _linear(n: int, k: int, fp8: bool, gen: torch.Generator) -> Linear:
    lin = Linear(k, n, fp8, torch.float32)
    w = torch.randn(n, k, generator=gen) * 0.05
    if fp8:
        q, s = quant_weight_block(w)
        lin.weight.data.copy_(q)
        lin.weight_scale_inv.data.copy_(s)  # type: ignore[union-attr]
    else:
        lin.weight.data.copy_(w)
    return lin


@pytest.mark.parametrize("fp8", [True, False], ids=["fp8", "bf16-free"])
def test_packed_equals_parts_and_shares_storage(fp8: bool) -> None:
    gen = torch.Generator().manual_seed(0)
    q_a, kv_a = _linear(256, 384, fp8, gen), _linear(72, 384, fp8, gen)  # 72: a partial block
    x = torch.randn(5, 384, generator=gen)
    expected = torch.cat([q_a(x), kv_a(x)], dim=-1)
    packed = pack_rows([q_a, kv_a])
    torch.testing.assert_close(packed(x), expected, rtol=1e-5, atol=1e-5)
    assert q_a.weight.data_ptr() == packed.weight.data_ptr()  # views, not copies
    assert kv_a.weight.data_ptr() == packed.weight[256:].data_ptr()
    torch.testing.assert_close(torch.cat([q_a(x), kv_a(x)], dim=-1), expected)


def test_fp8_parts_must_end_on_a_scale_block() -> None:
    gen = torch.Generator().manual_seed(1)
    parts = [_linear(96, 256, True, gen), _linear(72, 256, True, gen)]  # 96 % 128 != 0
    assert not can_pack(parts)
    with pytest.raises(ValueError, match="cannot be packed"):
        pack_rows(parts)
    assert can_pack([_linear(96, 256, False, gen), _linear(72, 256, False, gen)])


def test_bf16_model_runs_the_packed_projection(tiny_bf16_dir) -> None:
    """The HF logits tests (test_model_vs_hf.py) therefore check the packed path."""
    from model_utils import load_ours

    from dsv3serve.model.deepseek_v3 import MLAttention

    model = load_ours(tiny_bf16_dir, dtype=torch.float32)
    attns = [m for m in model.modules() if isinstance(m, MLAttention)]
    assert attns and all(a.qkv_a_proj is not None for a in attns)
    assert not any("qkv_a_proj" in name for name, _ in model.named_parameters())
