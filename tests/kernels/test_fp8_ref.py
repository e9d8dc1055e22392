"""FP8 block quantisation reference: checked against independent computations."""

from __future__ import annotations

import pytest
import torch

from dsv3serve.kernels.fp8_ref import (
    FP8_DTYPE,
    dequant_per_token_group,
    fp8_block_linear_ref,
    quant_per_token_group,
    quant_weight_block,
)

E4M3_REL_STEP = 2.0**-4  # half an ulp with 3 mantissa bits


def blockwise_dequant_loops(w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """Independent dequantisation: explicit loops over 128x128 blocks."""
    out = torch.empty(w.shape)
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            rows, cols = slice(128 * i, 128 * (i + 1)), slice(128 * j, 128 * (j + 1))
            out[rows, cols] = w[rows, cols].float() * s[i, j]
    return out


@pytest.mark.parametrize("shape", [(1, 128), (7, 300), (33, 1536)])
def test_per_token_group_quant_error_bound(shape) -> None:
    x = torch.randn(shape) * torch.logspace(-3, 2, shape[1])
    q, scale = quant_per_token_group(x)
    assert q.dtype == FP8_DTYPE and scale.shape == (shape[0], -(-shape[1] // 128))
    groups = torch.nn.functional.pad(x.abs(), (0, (-shape[1]) % 128)).view(shape[0], -1, 128)
    torch.testing.assert_close(scale, groups.amax(-1) / 448.0)
    err = (dequant_per_token_group(q, scale) - x).abs()
    bound = E4M3_REL_STEP * x.abs() + scale.repeat_interleave(128, 1)[:, : shape[1]] * 2.0**-9
    assert bool((err <= bound * 1.0001).all())


@pytest.mark.parametrize(("n", "k"), [(256, 128), (200, 300), (2112, 512)])
def test_block_weight_quant_roundtrip(n, k) -> None:
    w = torch.randn(n, k) * 0.05
    q, s = quant_weight_block(w)
    assert s.shape == (-(-n // 128), -(-k // 128))
    deq = blockwise_dequant_loops(q, s)
    subnormal_step = blockwise_dequant_loops(torch.ones(n, k), s) * 2.0**-9
    assert bool(((deq - w).abs() <= E4M3_REL_STEP * w.abs() + subnormal_step).all())


@pytest.mark.parametrize("act_quant", [False, True])
def test_fp8_linear_matches_dequantised_matmul(act_quant) -> None:
    torch.manual_seed(0)
    x = torch.randn(9, 384)
    q, s = quant_weight_block(torch.randn(256, 384) * 0.05)
    expected = x @ blockwise_dequant_loops(q, s).t()
    got = fp8_block_linear_ref(x, q, s, act_quant=act_quant)
    if act_quant:  # activation rounding: bounded by the e4m3 step of x times |W| row sums
        assert float((got - expected).norm() / expected.norm()) < 0.05
    else:
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
