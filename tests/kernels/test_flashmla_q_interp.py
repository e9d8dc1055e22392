"""FlashMLA's packed query (``dsv3serve.kernels.flashmla_q``): the Triton kernel against its
torch reference on CPU through Triton's interpreter (``TRITON_INTERPRET=1``, set by
tests/conftest.py without a GPU), and the reference's own contract (saturation, e4m3
rounding). Inputs are views with gaps between rows (as the model's q_pe is a view of
``q_b_proj``'s output) and a row count that leaves the last program part-filled."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")
from interp_util import INTERPRETING, gpu_like_casts  # noqa: E402

if not INTERPRETING:
    pytest.skip("needs TRITON_INTERPRET=1 set before pytest starts", allow_module_level=True)

from dsv3serve.kernels.flashmla_q import pack_q_ref, pack_q_triton  # noqa: E402

E4M3 = torch.float8_e4m3fn


@pytest.fixture(autouse=True)
def _casts():
    with gpu_like_casts():
        yield


def _inputs(t: int, h: int, r: int, p: int, std: float = 1.0, seed: int = 0):
    """q_latent [T, H, R] and q_pe [T, H, P] bf16, each a strided view of a wider tensor."""
    gen = torch.Generator().manual_seed(seed)
    wide = (torch.randn(t, h, r + p + 8, generator=gen) * std).to(torch.bfloat16)
    rope = (torch.randn(t, h + 3, p + 8, generator=gen) * std).to(torch.bfloat16)
    return wide[..., :r], rope[:, 1 : h + 1, 4 : p + 4]


@pytest.mark.parametrize(("t", "h"), [(1, 4), (3, 5), (2, 128)])
def test_bf16_is_the_concatenation(t: int, h: int) -> None:
    """Fewer rows than a program packs, a part-filled last program, DeepSeek-V3's heads."""
    q_latent, q_pe = _inputs(t, h, 64, 16)
    got = pack_q_triton(q_latent, q_pe, torch.bfloat16)
    assert got.is_contiguous() and got.shape == (t, h, 80)
    assert torch.equal(got, torch.cat([q_latent, q_pe], -1))


@pytest.mark.parametrize("q_scale", [1.0, 1 / 16, 4.0])
def test_e4m3_equals_the_reference_bit_for_bit(q_scale: float) -> None:
    q_latent, q_pe = _inputs(3, 5, 512, 64, std=3.0, seed=1)
    got = pack_q_triton(q_latent, q_pe, E4M3, 1 / q_scale)
    want = pack_q_ref(q_latent, q_pe, E4M3, 1 / q_scale)
    assert got.dtype == E4M3 and got.shape == (3, 5, 576)
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


def test_e4m3_saturates_past_448_times_the_scale() -> None:
    q_latent, q_pe = _inputs(2, 3, 64, 16)
    q_latent[0, 0, :4] = torch.tensor([1e4, -1e4, 447.0, 460.0]).to(torch.bfloat16)
    q_pe[1, 2, 0] = -3e5
    for pack in (pack_q_triton, pack_q_ref):
        got = pack(q_latent, q_pe, E4M3, 1.0).float()
        assert torch.isfinite(got).all()
        assert got[0, 0, :4].tolist() == [448.0, -448.0, 448.0, 448.0]
        assert got[1, 2, 64].item() == -448.0


def test_reference_rounds_within_e4m3s_step() -> None:
    """From 2^-6 * q_scale up: within 2^-4 of the value (3 mantissa bits, round to
    nearest); below: within half the subnormal step, 2^-10 * q_scale."""
    q_scale = 0.5
    q_latent, q_pe = _inputs(4, 8, 512, 64, std=2.0, seed=3)
    x = torch.cat([q_latent, q_pe], -1).float()
    back = pack_q_ref(q_latent, q_pe, E4M3, 1 / q_scale).float() * q_scale
    normal = x.abs() >= 2**-6 * q_scale
    assert ((back - x).abs() / x.abs())[normal].max() <= 2**-4
    assert (back - x).abs()[~normal].max() <= 2**-10 * q_scale


def test_contract_is_checked() -> None:
    q_latent, q_pe = _inputs(2, 3, 64, 16)
    with pytest.raises(ValueError, match=r"expected q_latent \[T, H, R\] and q_pe \[T, H, P\]"):
        pack_q_triton(q_latent, q_pe[:1], torch.bfloat16)
    with pytest.raises(ValueError, match="unit stride"):
        pack_q_triton(q_latent[..., ::2], q_pe, torch.bfloat16)
    with pytest.raises(ValueError, match="output dtype"):
        pack_q_triton(q_latent, q_pe, torch.float16)
    with pytest.raises(ValueError, match="power-of-two widths"):
        pack_q_triton(q_latent[..., :48], q_pe, torch.bfloat16)
