"""The masked grouped MoE (DeepEP low-latency layout) on the GPU, against its torch reference.

Skipped without CUDA (conftest). Padding rows are NaN and ``out`` starts as a
sentinel: valid rows must be finite and equal the reference, padding rows of ``out`` stay
the sentinel.

Tolerance, ``||y - ref|| / ||ref||`` over the valid rows: ``RTOL`` 1e-2. With e4m3 weights
the kernel multiplies bf16 activations by the dequantised weights in TF32 (10-bit mantissa:
~1e-3 per product, averaged over K) where the reference uses float32; with bf16 weights only
the summation order differs; then both round the same intermediates to bf16.
"""

from __future__ import annotations

import pytest
import torch

from dsv3serve.moe.experts import random_experts
from dsv3serve.moe.masked_moe import masked_moe_ref, masked_moe_triton

pytestmark = pytest.mark.gpu

RTOL = 1e-2
SENTINEL = 4096.0  # exact in bf16


def _case(fp8: bool, counts: list[int], m: int, h: int, inter: int, seed: int):
    torch.manual_seed(seed)
    stack = random_experts(len(counts), h, inter, fp8, torch.bfloat16, "cuda").stack()
    x = torch.full((len(counts), m, h), float("nan"), dtype=torch.bfloat16, device="cuda")
    for e, n in enumerate(counts):
        x[e, :n] = torch.randn(n, h, device="cuda").bfloat16()
    return stack, x, torch.tensor(counts, dtype=torch.int32, device="cuda")


def _check(got: torch.Tensor, want: torch.Tensor, counts: torch.Tensor, rtol: float = RTOL) -> None:
    valid = torch.arange(got.shape[1], device=got.device)[None, :] < counts[:, None]
    assert bool(torch.isfinite(got[valid]).all()), "padding leaked into a valid row"
    assert bool((got[~valid] == SENTINEL).all()), "a padding row was written"
    ref = want[valid].float()
    assert float((got[valid].float() - ref).norm() / ref.norm()) < rtol


@pytest.mark.parametrize("fp8", [True, False])
def test_masked_moe_deepseek_shapes(fp8: bool) -> None:
    """DeepSeek-V3's hidden and expert widths, 8 local experts of 256 rows (EP 8 x 32)."""
    counts = [0, 1, 37, 256, 128, 5, 200, 64]
    stack, x, c = _case(fp8, counts, 256, 7168, 2048, seed=len(counts) + fp8)
    out = torch.full_like(x, SENTINEL)
    _check(masked_moe_triton(x, c, stack, out=out), masked_moe_ref(x, c, stack), c)


def test_masked_moe_replays_in_a_cuda_graph() -> None:
    """Captured once, replayed with other counts and rows in the same static buffers."""
    stack, x, c = _case(True, [3, 0, 16, 9], 16, 512, 256, seed=7)
    out = torch.full_like(x, SENTINEL)
    masked_moe_triton(x, c, stack, out=out)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        masked_moe_triton(x, c, stack, out=out)
    _, x2, c2 = _case(True, [16, 4, 0, 1], 16, 512, 256, seed=8)
    x.copy_(x2)
    c.copy_(c2)
    out.fill_(SENTINEL)
    graph.replay()
    torch.cuda.synchronize()
    _check(out, masked_moe_ref(x, c, stack), c)


def test_masked_moe_full_width_ep2_slots() -> None:
    """DeepEP's low-latency layout at EP2 of DeepSeek-V3: 128 local experts of w13
    [4096, 7168] e4m3 (3.8 GB), tokens on slots past the int32 offset of slot 74. Int32
    offsets made this an illegal memory access (issue 28)."""
    counts = [0] * 128
    for slot, n in ((0, 3), (73, 5), (74, 7), (100, 2), (127, 11)):
        counts[slot] = n
    stack, x, c = _case(True, counts, 16, 7168, 2048, seed=28)
    out = torch.full_like(x, SENTINEL)
    got = masked_moe_triton(x, c, stack, out=out)
    torch.cuda.synchronize()
    _check(got, masked_moe_ref(x, c, stack), c)


def test_masked_moe_full_width_e4m3_rows() -> None:
    """DeepEP's FP8 dispatch at full width: e4m3 rows with scales stored per expert as
    [H/128, M] (DeepEP's layout), NaN padding, 128 local experts; bf16 out."""
    from dsv3serve.kernels.fp8_ref import FP8_DTYPE, quant_per_token_group

    torch.manual_seed(29)
    counts = [0] * 128
    for slot, n in ((1, 4), (74, 9), (127, 16)):
        counts[slot] = n
    e, m, h = 128, 16, 7168
    stack = random_experts(e, h, 2048, True, torch.bfloat16, "cuda").stack()
    q = torch.full((e, m, h), float("nan"), device="cuda").to(FP8_DTYPE)
    scales = torch.full((e, h // 128, m), float("nan"), device="cuda").transpose(1, 2)
    for i, n in enumerate(counts):
        if n:
            q[i, :n], scales[i, :n] = quant_per_token_group(torch.randn(n, h, device="cuda"))
    c = torch.tensor(counts, dtype=torch.int32, device="cuda")
    out = torch.full((e, m, h), SENTINEL, dtype=torch.bfloat16, device="cuda")
    got = masked_moe_triton(q, c, stack, out=out, x_scale=scales)
    torch.cuda.synchronize()
    # the intermediate goes through e4m3 on both sides: a rounding flip moves a value 1/16
    _check(got, masked_moe_ref(q, c, stack, x_scale=scales), c, rtol=2e-2)
