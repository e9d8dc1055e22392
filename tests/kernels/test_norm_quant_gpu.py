"""The fused add + RMSNorm + FP8 quantisation kernel against its torch reference on a GPU,
at DeepSeek-V3's hidden size (7168) and decode-to-prefill row counts. Bounds in
tests/support/norm_quant_cases.py; its time and bandwidth: ``dsv3serve bench kernels --only
fused``."""

from __future__ import annotations

import pytest
import torch
from fresh_seed import session_seed
from norm_quant_cases import assert_matches, random_inputs

from dsv3serve.kernels.fp8_gemm import fp8_block_gemm, fp8_block_gemm_quantized
from dsv3serve.kernels.fp8_ref import quant_weight_block
from dsv3serve.kernels.norm_quant import add_rmsnorm_quant_ref, add_rmsnorm_quant_triton

pytestmark = pytest.mark.gpu
SEED = session_seed()
HIDDEN = 7168


@pytest.mark.parametrize("seed", [SEED])
@pytest.mark.parametrize("m", [1, 8, 64, 1000])
@pytest.mark.parametrize(("with_residual", "write_normed"), [(True, False), (False, True)])
def test_kernel_equals_reference_dsv3_hidden(
    seed: int, m: int, with_residual: bool, write_normed: bool
) -> None:
    g = torch.Generator().manual_seed(seed)
    x, r, w = random_inputs(m, HIDDEN, with_residual, "cuda", g)
    out = add_rmsnorm_quant_triton(x, r, w, 1e-6, write_normed)
    assert_matches(out, add_rmsnorm_quant_ref(x, r, w, 1e-6, write_normed))


@pytest.mark.parametrize("m", [1, 64, 256])  # Triton GEMM at decode M, cuBLAS from 128
def test_quantized_output_feeds_the_gemm(m: int) -> None:
    """The kernel's e4m3 values and M-major scales, given to the GEMM dispatch, give what the
    unfused path gives (quantise the bf16 norm output, then GEMM) within 1% relative: they
    differ only where the norm's summation order flipped a rounding (one e4m3 step)."""
    g = torch.Generator().manual_seed(SEED)
    x, r, w = random_inputs(m, HIDDEN, True, "cuda", g)
    wq, ws = (t.cuda() for t in quant_weight_block(torch.randn(2112, HIDDEN, generator=g)))
    out = add_rmsnorm_quant_triton(x, r, w, 1e-6, write_normed=True)
    fused = fp8_block_gemm_quantized(out.q, out.scale, wq, ws).float()
    unfused = fp8_block_gemm(out.normed, wq, ws).float()
    rel = float((fused - unfused).norm() / unfused.norm())
    assert rel < 1e-2, f"expected fused GEMM input == unfused within 1%, got {rel:.3e}"
