"""The masked grouped MoE (DeepEP low-latency layout) against its torch reference, on CPU
through Triton's interpreter (``TRITON_INTERPRET=1``, set by tests/conftest.py without a GPU).

Padding rows (at or past ``counts[e]``) hold NaN: any read of them into a valid row would
turn that row NaN, so finite outputs equal to the reference prove padding is never read.
Inputs are fresh random per session (the seed is printed on failure). 16-bit activations are
fp16 here (the interpreter cannot multiply bf16 in ``tl.dot``; the kernel takes the same path
for both); the e4m3-weight path runs with bf16 activations (its dots are float32).

Tolerances, relative Frobenius error against the reference: 16-bit: 2e-3 (both round the
same intermediates to fp16; only float32 summation order differs, which can flip a rounding);
float32: 1e-5.
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")
from interp_util import INTERPRETING, gpu_like_casts  # noqa: E402

if not INTERPRETING:
    pytest.skip("needs TRITON_INTERPRET=1 set before pytest starts", allow_module_level=True)

from dsv3serve.moe.experts import random_experts  # noqa: E402
from dsv3serve.moe.masked_moe import masked_moe_ref, masked_moe_triton  # noqa: E402

SEED = int.from_bytes(os.urandom(4), "little")
RTOL = {torch.float16: 2e-3, torch.bfloat16: 2e-3, torch.float32: 1e-5}


@pytest.fixture(autouse=True)
def _casts():
    with gpu_like_casts():
        yield


def _poisoned(e: int, m: int, h: int, counts: list[int], dtype: torch.dtype, g) -> torch.Tensor:
    """[e, m, h] with random valid rows and NaN padding rows."""
    x = torch.full((e, m, h), float("nan"), dtype=dtype)
    for i, n in enumerate(counts):
        x[i, :n] = torch.randn(n, h, generator=g).to(dtype)
    return x


def _rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.float() - ref.float()).norm() / ref.float().norm().clamp(min=1e-30))


@pytest.mark.parametrize(
    ("fp8", "dtype", "counts", "m", "h", "inter"),
    [
        (True, torch.bfloat16, [5, 0, 17, 32], 32, 256, 128),  # an empty and a full expert
        (True, torch.bfloat16, [0, 0, 3], 24, 128, 256),
        (False, torch.float16, [7, 1, 0, 20], 24, 96, 80),  # K, N off the tile sizes
        (False, torch.float32, [9, 16], 16, 64, 48),
    ],
)
def test_masked_moe_matches_reference_and_never_reads_padding(fp8, dtype, counts, m, h, inter):
    g = torch.Generator().manual_seed(SEED)
    torch.manual_seed(SEED)
    stack = random_experts(len(counts), h, inter, fp8, dtype, "cpu").stack()
    x = _poisoned(len(counts), m, h, counts, dtype, g)
    c = torch.tensor(counts, dtype=torch.int32)
    sentinel = torch.full_like(x, 12345.0)
    got, want = masked_moe_triton(x, c, stack, out=sentinel.clone()), masked_moe_ref(x, c, stack)
    valid = torch.arange(m)[None, :] < c[:, None]
    assert bool(torch.isfinite(got[valid]).all()), f"padding leaked into a valid row (seed {SEED})"
    assert torch.equal(got[~valid], sentinel[~valid]), "a padding row was written"
    assert _rel_err(got[valid], want[valid]) < RTOL[dtype], f"seed {SEED}"


def test_masked_moe_reference_ignores_padding() -> None:
    """The reference itself: a NaN padding row changes nothing, and padding outputs are 0."""
    stack = random_experts(2, 64, 32, False, torch.float32, "cpu").stack()
    x = _poisoned(2, 8, 64, [3, 0], torch.float32, torch.Generator().manual_seed(SEED))
    out = masked_moe_ref(x, torch.tensor([3, 0], dtype=torch.int32), stack)
    assert bool(torch.isfinite(out).all()) and bool((out[0, 3:] == 0).all())


def test_masked_moe_refuses_wrong_shapes() -> None:
    stack = random_experts(2, 64, 32, False, torch.float32, "cpu").stack()
    x = torch.zeros(3, 8, 64)
    with pytest.raises(ValueError, match=r"expected w13 \[3, 2I, 64\]"):
        masked_moe_triton(x, torch.zeros(3, dtype=torch.int32), stack)
    with pytest.raises(ValueError, match=r"expected counts \[2\] int32"):
        masked_moe_triton(x[:2], torch.zeros(2, dtype=torch.int64), stack)
