"""The fused add + RMSNorm + FP8 quantisation kernel against its torch reference, on CPU
through Triton's interpreter (``TRITON_INTERPRET=1``, set by tests/conftest.py without a
GPU). Fresh random inputs each session (the seed is in the test id); bounds in
tests/support/norm_quant_cases.py."""

from __future__ import annotations

import pytest
import torch
from fresh_seed import session_seed

pytest.importorskip("triton")
from interp_util import INTERPRETING, gpu_like_casts  # noqa: E402

if not INTERPRETING:
    pytest.skip("needs TRITON_INTERPRET=1 set before pytest starts", allow_module_level=True)

from norm_quant_cases import assert_matches, random_inputs  # noqa: E402

from dsv3serve.kernels.norm_quant import (  # noqa: E402
    add_rmsnorm_quant_ref,
    add_rmsnorm_quant_triton,
)
from dsv3serve.layers.norm import RMSNorm  # noqa: E402

SEED = session_seed()


@pytest.fixture(autouse=True)
def _casts():
    with gpu_like_casts():
        yield


@pytest.mark.parametrize("seed", [SEED])
@pytest.mark.parametrize(
    ("m", "h", "with_residual", "write_normed"),
    [
        (3, 512, True, False),
        (5, 384, False, True),  # no residual (a stack's first norm), bf16 output too
        (2, 200, True, True),  # H not a multiple of 128: a partial last group
        (1, 1024, True, False),
    ],
)
def test_kernel_equals_reference(
    seed: int, m: int, h: int, with_residual: bool, write_normed: bool
) -> None:
    g = torch.Generator().manual_seed(seed)
    x, r, w = random_inputs(m, h, with_residual, "cpu", g)
    out = add_rmsnorm_quant_triton(x, r, w, 1e-6, write_normed)
    assert_matches(out, add_rmsnorm_quant_ref(x, r, w, 1e-6, write_normed))


def test_reference_is_the_models_norm() -> None:
    """The reference composes the model's own ops: the add and RMSNorm's forward."""
    g = torch.Generator().manual_seed(SEED)
    x, r, w = random_inputs(4, 256, True, "cpu", g)
    norm = RMSNorm(256, 1e-6)
    norm.weight.data.copy_(w)
    ref = add_rmsnorm_quant_ref(x, r, w, 1e-6, write_normed=True)
    assert torch.equal(ref.normed, norm(x + r))


@pytest.mark.parametrize("seed", [SEED])
def test_unquantised_output_skips_the_fp8(seed: int) -> None:
    """``quantize=False`` (a MoE layer's post-attention norm): the residual and the bf16
    norm output are the reference's, and no FP8 values or scales are written."""
    g = torch.Generator().manual_seed(seed)
    x, r, w = random_inputs(3, 384, True, "cpu", g)
    out = add_rmsnorm_quant_triton(x, r, w, 1e-6, write_normed=True, quantize=False)
    ref = add_rmsnorm_quant_ref(x, r, w, 1e-6, write_normed=True)
    assert out.q.shape == (3, 0) and out.scale.shape == (3, 0)
    assert torch.equal(out.residual, ref.residual)
    torch.testing.assert_close(out.normed.float(), ref.normed.float(), rtol=2**-6, atol=1e-30)
    unq = add_rmsnorm_quant_ref(x, r, w, 1e-6, write_normed=True, quantize=False)
    assert unq.q.shape == (3, 0) and torch.equal(unq.normed, ref.normed)


@pytest.mark.parametrize("seed", [SEED])
def test_rmsnorm_module_fused_form(seed: int) -> None:
    """RMSNorm switched to its one-kernel form gives the reference's output within the
    fused norm's bound; a strided input falls back to the reference ops themselves."""
    g = torch.Generator().manual_seed(seed)
    x, _, w = random_inputs(5, 384, False, "cpu", g)
    norm = RMSNorm(384, 1e-6)
    norm.weight.data.copy_(w)
    ref = norm(x)
    norm.fused = True  # what plan_fusion decides on a CUDA device
    torch.testing.assert_close(norm(x).float(), ref.float(), rtol=2**-6, atol=1e-30)
    wide = torch.cat([x, x], -1)[:, :384]  # a strided view, as a split hands it
    assert torch.equal(norm(wide), ref)
