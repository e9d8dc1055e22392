"""The DeepGEMM grouped-GEMM MoE glue (dsv3serve/moe/deepgemm_moe.py) on the CPU, over the
fake ``deep_gemm`` (tests/support/fake_deep_gemm.py: torch GEMMs that assert DeepGEMM's
layouts: 128-row expert blocks with -1 past the used ones, int32 counts), against the
references: the routed experts of ``TorchRefMoE`` (contiguous) and ``masked_moe_ref``
(masked, NaN padding rows that must never reach a valid row).

Tolerance, relative Frobenius error: 2e-2 (both sides round the same intermediates through
e4m3 per 128 channels, in a different order; one flip moves a value by 1/16).
"""

from __future__ import annotations

import pytest
import torch
from fake_deep_gemm import make_fake_deep_gemm

from dsv3serve.kernels.fp8_ref import quant_per_token_group
from dsv3serve.moe.deepgemm_moe import deepgemm_moe_contiguous, deepgemm_moe_masked
from dsv3serve.moe.experts import random_experts
from dsv3serve.moe.masked_moe import masked_moe_ref
from dsv3serve.moe.ref import TorchRefMoE

RTOL = 2e-2
FAKE = make_fake_deep_gemm("correct")


def _rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.float() - ref.float()).norm() / ref.float().norm())


@pytest.mark.parametrize(("t", "e", "top_k", "skipped"), [(10, 4, 2, False), (37, 6, 3, True)])
def test_contiguous_matches_the_reference(t: int, e: int, top_k: int, skipped: bool) -> None:
    torch.manual_seed(t)
    ex = random_experts(e, 256, 128, True, torch.bfloat16, "cpu")
    x = torch.randn(t, 256).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(e)[:top_k] for _ in range(t)]).int()
    if skipped:  # another EP rank's experts: -1 with weight 0
        ids[::3, 0] = -1
    w = torch.rand(t, top_k).where(ids >= 0, torch.zeros(()))
    y = deepgemm_moe_contiguous(FAKE, x, w, ids, ex.stack(False))
    ref = TorchRefMoE(act_quant=True).forward(x, w, ids, ex)
    assert y.dtype == x.dtype and y.shape == x.shape
    assert _rel_err(y, ref) < RTOL


def test_contiguous_with_no_rows_for_this_rank() -> None:
    ex = random_experts(2, 128, 128, True, torch.bfloat16, "cpu")
    x = torch.randn(3, 128).to(torch.bfloat16)
    ids = torch.full((3, 2), -1, dtype=torch.int32)
    y = deepgemm_moe_contiguous(FAKE, x, torch.zeros(3, 2), ids, ex.stack(False))
    assert bool((y == 0).all())


def _poisoned_fp8(counts: list[int], m: int, h: int) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 rows [E, M, H] with scales [E, M, H/128], NaN scales on padding rows."""
    x = torch.randn(len(counts), m, h)
    q, s = quant_per_token_group(x.view(-1, h))
    q, s = q.view(len(counts), m, h), s.view(len(counts), m, -1)
    for i, n in enumerate(counts):
        s[i, n:] = float("nan")
    return q, s


@pytest.mark.parametrize("counts", [[5, 0, 17, 32], [0, 0, 3]])
def test_masked_matches_the_reference(counts: list[int]) -> None:
    torch.manual_seed(len(counts))
    ex = random_experts(len(counts), 256, 128, True, torch.bfloat16, "cpu")
    xq, xs = _poisoned_fp8(counts, 32, 256)
    c = torch.tensor(counts, dtype=torch.int32)
    y = deepgemm_moe_masked(FAKE, xq, c, ex.stack(False), expected_m=16, x_scale=xs)
    ref = masked_moe_ref(xq, c, ex.stack(False), x_scale=xs)
    for i, n in enumerate(counts):
        if n:
            assert bool(torch.isfinite(y[i, :n]).all()), f"expert {i}: padding reached a row"
            assert _rel_err(y[i, :n], ref[i, :n]) < RTOL, f"expert {i}"


def test_masked_bf16_rows_into_out() -> None:
    ex = random_experts(2, 128, 128, True, torch.bfloat16, "cpu")
    x = torch.randn(2, 8, 128).to(torch.bfloat16)
    out = torch.full((2, 8, 128), 7.0, dtype=torch.bfloat16)
    c = torch.tensor([8, 4], dtype=torch.int32)
    y = deepgemm_moe_masked(FAKE, x, c, ex.stack(False), expected_m=6, out=out)
    assert y.data_ptr() == out.data_ptr() and bool((out[1, 4:] == 7.0).all())


def test_refuses_bf16_weights_and_bad_counts() -> None:
    ex = random_experts(2, 128, 128, False, torch.bfloat16, "cpu")
    x = torch.randn(2, 8, 128).to(torch.bfloat16)
    with pytest.raises(ValueError, match="e4m3 expert weights"):
        deepgemm_moe_masked(FAKE, x, torch.tensor([1, 2], dtype=torch.int32), ex.stack(False), 2)
    fp8 = random_experts(2, 128, 128, True, torch.bfloat16, "cpu")
    with pytest.raises(ValueError, match="counts \\[2\\] int32"):
        deepgemm_moe_masked(FAKE, x, torch.tensor([1, 2]), fp8.stack(False), 2)
