"""FP8 kernels (Triton quant, Triton and cuBLAS block GEMM) against the torch reference.

Skipped without CUDA (conftest). Tolerances:

- quantisation: the e4m3 bytes and the float32 scales equal the reference's on the same device
  exactly (same formula, IEEE division, round-to-nearest-even conversion);
- GEMM: ``||y - ref|| / ||ref|| < GEMM_RTOL`` with ``ref`` the float32 product of the
  dequantised operands. Both sides see the same e4m3 inputs, so what differs is the order of
  the float32 sums and the bf16 rounding of the output (2^-9 relative at most, ~1e-3 in norm).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from dsv3serve.kernels.fp8_gemm import (
    GemmConfig,
    cublas_supported,
    fp8_block_gemm,
    fp8_block_gemm_cublas,
    fp8_block_gemm_triton,
    num_sms,
    pick_config,
)
from dsv3serve.kernels.fp8_quant import quant_per_token_group_fp8
from dsv3serve.kernels.fp8_ref import (
    dequant_per_token_group,
    dequant_weight_block,
    fp8_block_linear_ref,
    quant_per_token_group,
    quant_weight_block,
)
from dsv3serve.layers.linear import fp8_linear

pytestmark = pytest.mark.gpu

# DeepSeek-V3 FP8 linears (N x K): fused q/kv-a, q-b, kv-b, o, dense gate+up, dense down.
SHAPES = [(2112, 7168), (24576, 1536), (32768, 512), (7168, 16384), (36864, 7168), (7168, 18432)]
MS = [1, 7, 64, 255, 1024, 4096]
GEMM_RTOL = 1e-2


def _activations(m: int, k: int) -> torch.Tensor:
    """bf16 rows whose channels span five decades, so every group has its own scale."""
    spread = torch.logspace(-2, 3, k, device="cuda")[torch.randperm(k, device="cuda")]
    return (torch.randn(m, k, device="cuda") * spread).to(torch.bfloat16)


def _rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    assert bool(torch.isfinite(y).all()), "non-finite output (unwritten or overflow)"
    return float((y.float() - ref).norm() / ref.norm())


@pytest.fixture(scope="module", params=SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def weight(request: pytest.FixtureRequest) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    n, k = request.param
    w, ws = quant_weight_block(torch.randn(n, k, device="cuda") * 0.02)
    return w, ws, dequant_weight_block(w, ws)


@pytest.mark.parametrize("m", MS)
@pytest.mark.parametrize("k", sorted({k for _, k in SHAPES} | {300}))
def test_quant_matches_reference_bytes(m: int, k: int) -> None:
    x = _activations(m, k)
    x[:, :128] = 0  # an all-zero group takes the 1e-10 floor
    q, s = quant_per_token_group_fp8(x)
    q_ref, s_ref = quant_per_token_group(x)
    assert s.shape == s_ref.shape and s.stride() == s_ref.stride()
    assert torch.equal(s, s_ref), f"{int((s != s_ref).sum())} scales differ"
    diff = int((q.view(torch.uint8) != q_ref.view(torch.uint8)).sum())
    assert diff == 0, f"{diff} of {q.numel()} e4m3 bytes differ"


@pytest.mark.parametrize("m", [1, 7, 1024])
def test_quant_m_major_scales(m: int) -> None:
    x = _activations(m, 7168)
    q, s = quant_per_token_group_fp8(x, m_major_scales=True)
    q_ref, s_ref = quant_per_token_group(x)
    assert s.stride() == (1, m)
    assert torch.equal(s, s_ref) and torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))


def _reference(x: torch.Tensor, w_deq: torch.Tensor) -> tuple[torch.Tensor, ...]:
    xq, xs = quant_per_token_group(x)
    return xq, xs, dequant_per_token_group(xq, xs) @ w_deq.t()


@pytest.mark.parametrize("m", MS)
def test_triton_gemm(weight, m: int) -> None:
    w, ws, w_deq = weight
    xq, xs, ref = _reference(_activations(m, w.shape[1]), w_deq)
    out = torch.full((m, w.shape[0]), float("nan"), dtype=torch.bfloat16, device="cuda")
    y = fp8_block_gemm_triton(xq, xs, w, ws, out=out)
    assert y.data_ptr() == out.data_ptr()
    assert _rel_err(y, ref) < GEMM_RTOL


@pytest.mark.parametrize("split_k", [1, 3, 8])
def test_triton_gemm_split_k(split_k: int) -> None:
    w, ws = quant_weight_block(torch.randn(2112, 7168, device="cuda") * 0.02)
    xq, xs, ref = _reference(_activations(5, 7168), dequant_weight_block(w, ws))
    y = fp8_block_gemm_triton(xq, xs, w, ws, config=GemmConfig(16, 64, split_k, 4, 4))
    assert _rel_err(y, ref) < GEMM_RTOL


def test_triton_gemm_ragged_k() -> None:
    w, ws = quant_weight_block(torch.randn(200, 300, device="cuda") * 0.02)
    xq, xs, ref = _reference(_activations(9, 300), dequant_weight_block(w, ws))
    assert _rel_err(fp8_block_gemm_triton(xq, xs, w, ws), ref) < GEMM_RTOL


@pytest.mark.parametrize("m", [1, 7, 32, 64, 255])
def test_triton_gemm_swap_ab(weight, m: int) -> None:
    w, ws, w_deq = weight
    xq, xs, ref = _reference(_activations(m, w.shape[1]), w_deq)
    cfg = replace(pick_config(m, *w.shape, num_sms(0)), swap_ab=True)
    assert _rel_err(fp8_block_gemm_triton(xq, xs, w, ws, config=cfg), ref) < GEMM_RTOL


@pytest.mark.parametrize("m", MS)
def test_cublas_gemm(weight, m: int) -> None:
    w, ws, w_deq = weight
    assert cublas_supported(*w.shape)
    xq, xs, ref = _reference(_activations(m, w.shape[1]), w_deq)
    y = fp8_block_gemm_cublas(xq, xs, w, ws)
    assert y.shape == (m, w.shape[0]) and y.dtype == torch.bfloat16
    assert _rel_err(y, ref) < GEMM_RTOL


@pytest.mark.parametrize("m", [1, 64, 4096])
def test_dispatch_and_linear_match_reference(weight, m: int) -> None:
    w, ws, w_deq = weight
    x = _activations(m, w.shape[1])
    ref = _reference(x, w_deq)[2]
    for backend in ("auto", "triton", "cublas"):
        assert _rel_err(fp8_block_gemm(x, w, ws, backend=backend), ref) < GEMM_RTOL, backend
    y = fp8_linear(x.view(1, m, -1), w, ws)
    assert y.shape == (1, m, w.shape[0]) and y.dtype == torch.bfloat16
    assert _rel_err(y.view(m, -1), ref) < GEMM_RTOL
    if m == 1:  # float32 activations keep the reference path and its dtype
        xf = x.float()
        torch.testing.assert_close(fp8_linear(xf, w, ws), fp8_block_linear_ref(xf, w, ws))


@pytest.mark.parametrize(("n", "k"), [(576, 256), (384, 640)])  # K blocks not a multiple of 4
def test_auto_dispatch_keeps_small_k_off_cublas(n: int, k: int) -> None:
    """torch's cuBLAS block scaling wants K/128 in multiples of 4 (it rejected K = 256 from
    the tiny model); the auto dispatch sends such weights to Triton at every M."""
    assert not cublas_supported(n, k)
    w, ws = quant_weight_block(torch.randn(n, k, device="cuda") * 0.02)
    ref_w = dequant_weight_block(w, ws)
    for m in (1, 64, 4096):
        x = _activations(m, k)
        ref = _reference(x, ref_w)[2]
        assert _rel_err(fp8_block_gemm(x, w, ws), ref) < GEMM_RTOL
