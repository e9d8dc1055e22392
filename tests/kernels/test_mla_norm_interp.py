"""The MLA q/kv norms kernel against its torch reference, on CPU through Triton's interpreter
(``TRITON_INTERPRET=1``, set by tests/conftest.py without a GPU). Fresh random inputs each
session (the seed is in the test id); outputs start NaN so unwritten entries show; bounds
in tests/support/mla_fusion_cases.py."""

from __future__ import annotations

import pytest
import torch
from fresh_seed import session_seed

pytest.importorskip("triton")
from interp_util import INTERPRETING, gpu_like_casts  # noqa: E402

if not INTERPRETING:
    pytest.skip("needs TRITON_INTERPRET=1 set before pytest starts", allow_module_level=True)

from mla_fusion_cases import assert_norms_match, poisoned_allocations, qkv_inputs  # noqa: E402

from dsv3serve.kernels.mla_norm import qkv_a_rmsnorm_ref, qkv_a_rmsnorm_triton  # noqa: E402
from dsv3serve.layers.norm import RMSNorm  # noqa: E402

SEED = session_seed()


@pytest.fixture(autouse=True)
def _casts():
    with gpu_like_casts():
        yield


@pytest.mark.parametrize("seed", [SEED])
@pytest.mark.parametrize(
    ("t", "q_dim", "r", "p", "quantize"),
    [
        (3, 384, 128, 32, True),
        (2, 96, 64, 16, True),  # the tiny model: Q not a multiple of 128 (a partial group)
        (4, 256, 64, 16, False),  # bf16 q for a bf16 q_b_proj
        (1, 1536, 512, 64, True),  # DeepSeek-V3's widths, one decode token
    ],
)
def test_kernel_equals_reference(
    seed: int, t: int, q_dim: int, r: int, p: int, quantize: bool
) -> None:
    g = torch.Generator().manual_seed(seed)
    packed, q_w, kv_w = qkv_inputs(t, q_dim, r, p, "cpu", g)
    q_a, kv_a = packed.split([q_dim, r + p], -1)  # strided views, as the model passes them
    with poisoned_allocations():
        out = qkv_a_rmsnorm_triton(q_a, kv_a, q_w, kv_w, 1e-6, 1e-6, quantize)
    ref = qkv_a_rmsnorm_ref(q_a, kv_a, q_w, kv_w, 1e-6, 1e-6, quantize)
    assert_norms_match(out, ref, r, quantize)


@pytest.mark.parametrize("seed", [SEED])
def test_separate_inputs(seed: int) -> None:
    """q_a and kv_a as two tensors (an unpacked down-projection) give the same result."""
    g = torch.Generator().manual_seed(seed)
    packed, q_w, kv_w = qkv_inputs(3, 256, 64, 16, "cpu", g)
    q_a, kv_a = (part.contiguous() for part in packed.split([256, 80], -1))
    out = qkv_a_rmsnorm_triton(q_a, kv_a, q_w, kv_w, 1e-6, 1e-6, True)
    assert_norms_match(out, qkv_a_rmsnorm_ref(q_a, kv_a, q_w, kv_w, 1e-6, 1e-6, True), 64, True)


def test_reference_is_the_models_norms() -> None:
    """The reference's normed q and latent are the model's RMSNorm modules' outputs."""
    g = torch.Generator().manual_seed(SEED)
    packed, q_w, kv_w = qkv_inputs(4, 256, 64, 16, "cpu", g)
    q_norm, kv_norm = RMSNorm(256, 1e-6), RMSNorm(64, 1e-6)
    q_norm.weight.data.copy_(q_w)
    kv_norm.weight.data.copy_(kv_w)
    q_a, kv_a = packed.split([256, 80], -1)
    ref = qkv_a_rmsnorm_ref(q_a, kv_a, q_w, kv_w, 1e-6, 1e-6, quantize=False)
    assert torch.equal(ref.q, q_norm(q_a))
    assert torch.equal(ref.latent, torch.cat([kv_norm(kv_a[:, :64]), kv_a[:, 64:]], -1))
