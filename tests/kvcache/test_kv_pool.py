"""MLAKVPool: write/read round trips (bf16, fp32, fp8 e4m3), slot mapping, page bytes."""

from __future__ import annotations

import pytest
import torch

from dsv3serve.kvcache.pool import (
    FP8_E4M3_MAX,
    MLA_KV_DIM,
    MLAKVPool,
    bytes_per_page,
    pages_for_tokens,
)

DEVICES = ["cpu", *(["cuda"] if torch.cuda.is_available() else [])]
# e4m3 has 3 mantissa bits: a normal value is off by at most 1/16 of itself; values below
# the smallest normal (2**-6 in units of the scale) are off by at most half of 2**-9.
FP8_REL_TOL = 2.0**-4
FP8_SUBNORMAL_ABS = 2.0**-10


def _random_slots(pool: MLAKVPool, count: int, device: str) -> torch.Tensor:
    return torch.randperm(pool.num_slots, device=device)[:count]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_round_trip_exact(device: str, dtype: torch.dtype) -> None:
    pool = MLAKVPool(num_layers=3, num_pages=8, page_size=4, dtype=dtype, device=device)
    slots = _random_slots(pool, 13, device)
    latent = torch.randn(13, MLA_KV_DIM, device=device).to(dtype)
    pool.write(1, slots, latent)
    assert pool.read(1, slots).dtype == dtype
    torch.testing.assert_close(pool.read(1, slots), latent, rtol=0, atol=0)
    assert pool.kv_buffer(0).abs().sum() == 0 and pool.kv_buffer(2).abs().sum() == 0
    assert pool.scale_buffer(1) is None


@pytest.mark.parametrize("device", DEVICES)
def test_fp8_round_trip_within_e4m3_tolerance(device: str) -> None:
    pool = MLAKVPool(2, 8, 16, dtype=torch.float8_e4m3fn, device=device)
    assert pool.compute_dtype == torch.bfloat16
    slots = _random_slots(pool, 40, device)
    magnitudes = torch.logspace(-3, 2, 40, device=device)[:, None]
    latent = torch.randn(40, MLA_KV_DIM, device=device) * magnitudes
    latent[3] = 0.0  # an all-zero token must stay finite
    pool.write(0, slots, latent)
    restored = pool.read(0, slots)
    assert restored.dtype == torch.bfloat16 and torch.isfinite(restored).all()
    scale = latent.abs().amax(dim=-1, keepdim=True) / FP8_E4M3_MAX
    bound = FP8_REL_TOL * latent.abs() + FP8_SUBNORMAL_ABS * scale
    bf16_rounding = 2.0**-8 * latent.abs()
    error = (restored.float() - latent).abs()
    assert (error <= bound + bf16_rounding + 1e-30).all(), f"max excess {(error - bound).max()}"
    stored_scale = pool.scale_buffer(0)
    assert stored_scale is not None and stored_scale.shape == (8, 16)
    assert stored_scale.dtype == torch.float32


def test_fp8_read_in_float32_compute_dtype() -> None:
    pool = MLAKVPool(1, 2, 4, dtype=torch.float8_e4m3fn, compute_dtype=torch.float32)
    slots = torch.tensor([0, 5])
    latent = torch.tensor([[1.0] * MLA_KV_DIM, [-448.0] * MLA_KV_DIM])
    pool.write(0, slots, latent)
    torch.testing.assert_close(pool.read(0, slots), latent)


def test_slot_mapping_is_page_times_page_size_plus_offset() -> None:
    page_size = 4
    pool = MLAKVPool(2, num_pages=5, page_size=page_size, dtype=torch.float32)
    page, offset = 3, 2
    row = torch.arange(MLA_KV_DIM, dtype=torch.float32)[None]
    pool.write(1, torch.tensor([page * page_size + offset]), row)
    buffer = pool.kv_buffer(1)
    assert torch.equal(buffer[page, offset], row[0])
    assert buffer.abs().sum() == row.abs().sum(), "no other row was written"


def test_argument_checks_name_expected_and_found() -> None:
    pool = MLAKVPool(1, 2, 4)
    with pytest.raises(ValueError, match=r"expected shape \[2, 576\], got \[2, 512\]"):
        pool.write(0, torch.tensor([0, 1]), torch.zeros(2, 512))
    with pytest.raises(ValueError, match="int64/int32"):
        pool.read(0, torch.tensor([0.0]))
    with pytest.raises(ValueError, match="KV cache dtype"):
        MLAKVPool(1, 2, 4, dtype=torch.float16)


def test_sizing_helpers() -> None:
    assert pages_for_tokens(17, 16) == 2
    assert bytes_per_page(61, 64, torch.bfloat16) == 61 * 64 * 576 * 2
    assert bytes_per_page(61, 64, torch.float8_e4m3fn) == 61 * 64 * (576 + 4)
    for dtype in (torch.bfloat16, torch.float8_e4m3fn, torch.float32):
        pool = MLAKVPool(3, 5, 8, dtype=dtype)
        tensors = [pool.kv_buffer(i) for i in range(3)]
        tensors += [t for t in (pool.scale_buffer(i) for i in range(3)) if t is not None]
        assert pool.nbytes == sum(t.numel() * t.element_size() for t in tensors)
        assert pool.nbytes == 5 * bytes_per_page(3, 8, dtype)


@pytest.mark.parametrize("device", DEVICES)
def test_fp8_layer_scales_round_trip_saturate_and_flush(device: str) -> None:
    """FlashMLA's layout: one fixed scale per layer; beyond 448 * scale a value saturates
    (never NaN), below 2^-10 * scale it rounds to zero."""
    fp8 = torch.float8_e4m3fn
    pool = MLAKVPool(2, 8, 16, dtype=fp8, device=device, fp8_scales="layer", layer_scale=0.25)
    assert pool.is_fp8 and not pool.token_scales and pool.scale_buffer(0) is None
    assert pool.layer_scale(1).tolist() == [0.25] and pool.layer_inv_scale(1).tolist() == [4.0]
    slots = _random_slots(pool, 20, device)
    latent = torch.randn(20, MLA_KV_DIM, device=device) * 10  # within 448 * 0.25 = 112
    latent[0, :4] = torch.tensor([1e4, -1e4, 112.0, 1e-6])
    pool.write(0, slots, latent)
    back = pool.read(0, slots).float()
    assert torch.isfinite(back).all() and back[0, :4].tolist() == [112.0, -112.0, 112.0, 0.0]
    rest = latent[1:]
    bound = FP8_REL_TOL * rest.abs() + FP8_SUBNORMAL_ABS * 0.25 + 2.0**-8 * rest.abs()
    assert ((back[1:] - rest).abs() <= bound).all()
    assert pool.kv_buffer(1).float().abs().sum() == 0


def test_fp8_layer_scale_pool_is_half_the_bf16_bytes() -> None:
    fp8 = torch.float8_e4m3fn
    assert bytes_per_page(61, 64, fp8, token_scales=False) == 61 * 64 * 576
    pool = MLAKVPool(3, 5, 8, dtype=fp8, fp8_scales="layer")
    assert pool.nbytes * 2 == MLAKVPool(3, 5, 8).nbytes == 5 * pool.page_nbytes * 2
    with pytest.raises(ValueError, match="fp8_scales: expected one of"):
        MLAKVPool(1, 2, 4, dtype=fp8, fp8_scales="tensor")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="layer_scale: expected a finite value > 0, got 0"):
        MLAKVPool(1, 2, 4, dtype=fp8, fp8_scales="layer", layer_scale=0.0)
