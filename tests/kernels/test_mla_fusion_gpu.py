"""The MLA fusion kernels against their torch references on a GPU, at DeepSeek-V3's widths
(q_lora_rank 1536, kv_lora_rank 512, rope 64, 128 heads) and decode-to-prefill token
counts, on fresh random inputs with NaN-poisoned outputs. Bounds in
tests/support/mla_fusion_cases.py; their time beside the reference ops':
``dsv3serve bench kernels --only fused``."""

from __future__ import annotations

import pytest
import torch
from fresh_seed import session_seed
from mla_fusion_cases import assert_norms_match, poisoned_allocations, qkv_inputs
from rope_kv_cases import check_against_reference, check_layer_scaled, rope_inputs

from dsv3serve.kernels.fp8_gemm import fp8_block_gemm, fp8_block_gemm_quantized
from dsv3serve.kernels.fp8_ref import quant_weight_block
from dsv3serve.kernels.mla_norm import qkv_a_rmsnorm_ref, qkv_a_rmsnorm_triton
from dsv3serve.kernels.rope_kv import rope_kv_write_ref, rope_kv_write_triton

pytestmark = pytest.mark.gpu
SEED = session_seed()
Q, R, P, HEADS = 1536, 512, 64, 128


@pytest.mark.parametrize("seed", [SEED])
@pytest.mark.parametrize("t", [1, 8, 64, 1000])
@pytest.mark.parametrize("quantize", [True, False])
def test_norms_equal_reference_dsv3(seed: int, t: int, quantize: bool) -> None:
    g = torch.Generator().manual_seed(seed)
    packed, q_w, kv_w = qkv_inputs(t, Q, R, P, "cuda", g)
    q_a, kv_a = packed.split([Q, R + P], -1)
    with poisoned_allocations():
        out = qkv_a_rmsnorm_triton(q_a, kv_a, q_w, kv_w, 1e-6, 1e-6, quantize)
    ref = qkv_a_rmsnorm_ref(q_a, kv_a, q_w, kv_w, 1e-6, 1e-6, quantize)
    assert_norms_match(out, ref, R, quantize)


@pytest.mark.parametrize("seed", [SEED])
@pytest.mark.parametrize("t", [1, 8, 64, 1000])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_rope_kv_write_equals_reference_dsv3(seed: int, t: int, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(seed)
    case = rope_inputs(t, R, P, HEADS, dtype, "cuda", g)
    check_against_reference(case, rope_kv_write_triton, rope_kv_write_ref)


@pytest.mark.parametrize("seed", [SEED])
@pytest.mark.parametrize("t", [1, 64, 1000])
def test_rope_kv_write_into_a_layer_scaled_fp8_pool(seed: int, t: int) -> None:
    """FlashMLA's fp8 layout: one scale per layer, saturating."""
    g = torch.Generator().manual_seed(seed)
    case = rope_inputs(t, R, P, HEADS, torch.float8_e4m3fn, "cuda", g)
    for write in (rope_kv_write_triton, rope_kv_write_ref):
        check_layer_scaled(case, write)


@pytest.mark.parametrize("t", [1, 64])
def test_quantized_q_feeds_q_b_proj(t: int) -> None:
    """The fused q's e4m3 values and M-major scales, given to the GEMM dispatch, give what
    the unfused path gives (quantise the bf16 norm output, then GEMM) within 1% relative."""
    g = torch.Generator().manual_seed(SEED)
    packed, q_w, kv_w = qkv_inputs(t, Q, R, P, "cuda", g)
    q_a, kv_a = packed.split([Q, R + P], -1)
    wq, ws = (x.cuda() for x in quant_weight_block(torch.randn(HEADS * 192, Q, generator=g)))
    fused_q = qkv_a_rmsnorm_triton(q_a, kv_a, q_w, kv_w, 1e-6, 1e-6, True)
    normed = qkv_a_rmsnorm_triton(q_a, kv_a, q_w, kv_w, 1e-6, 1e-6, False).q
    fused = fp8_block_gemm_quantized(fused_q.q, fused_q.scale, wq, ws).float()
    unfused = fp8_block_gemm(normed, wq, ws).float()
    rel = float((fused - unfused).norm() / unfused.norm())
    assert rel < 1e-2, f"expected fused GEMM input == unfused within 1%, got {rel:.3e}"
