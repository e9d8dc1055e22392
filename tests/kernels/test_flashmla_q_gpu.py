"""FlashMLA's packed query (``dsv3serve.kernels.flashmla_q``) on a GPU, at DeepSeek-V3's
widths (512 + 64, 128 heads): the Triton kernel equals its torch reference bit for bit
(bf16 and e4m3, values past 448 included), from the views the model passes."""

from __future__ import annotations

import pytest
import torch

from dsv3serve.kernels.flashmla_q import pack_q, pack_q_ref

pytestmark = pytest.mark.gpu
R, P, HEADS = 512, 64, 128


def _inputs(t: int) -> tuple[torch.Tensor, torch.Tensor]:
    """q_latent contiguous (an einsum's output), q_pe a view with gaps (rotated rope part of
    a wider buffer); a few values past e4m3's range."""
    q_latent = (torch.randn(t, HEADS, R, device="cuda") * 4).to(torch.bfloat16)
    wide = (torch.randn(t, HEADS, 192, device="cuda") * 4).to(torch.bfloat16)
    q_latent[0, 0, :2] = torch.tensor([1e4, -600.0])
    return q_latent, wide[..., 128:]


@pytest.mark.parametrize("t", [1, 7, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=["bf16", "e4m3"])
def test_kernel_equals_reference(t: int, dtype: torch.dtype) -> None:
    q_latent, q_pe = _inputs(t)
    got = pack_q(q_latent, q_pe, dtype, 1.0)
    want = pack_q_ref(q_latent, q_pe, dtype, 1.0)
    assert got.is_contiguous() and got.shape == (t, HEADS, R + P)
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    if dtype == torch.float8_e4m3fn:
        assert got[0, 0, :2].float().tolist() == [448.0, -448.0]
