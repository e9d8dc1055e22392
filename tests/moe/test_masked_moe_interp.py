"""The masked grouped MoE (DeepEP low-latency layout) against its torch reference, on CPU
through Triton's interpreter (``TRITON_INTERPRET=1``, set by tests/conftest.py without a GPU).

Padding rows (at or past ``counts[e]``) hold NaN: any read of them into a valid row would
turn that row NaN, so finite outputs equal to the reference prove padding is never read.
Inputs are fresh random per session (the seed is printed on failure). 16-bit activations are
fp16 here (the interpreter cannot multiply bf16 in ``tl.dot``; the kernels take the same path
for both), also with e4m3 weights (upcast to the activation dtype in registers). e4m3 rows
with per-128 scales (DeepEP's FP8 dispatch) take the fused MoE's e4m3 tensor-core path.

Tolerances, relative Frobenius error against the reference: 16-bit: 2e-3 (both round the
same intermediates to fp16; only float32 summation order differs, which can flip a rounding);
float32: 1e-5.
"""

from __future__ import annotations

import pytest
import torch
from fresh_seed import session_seed

pytest.importorskip("triton")
from interp_util import INTERPRETING, gpu_like_casts  # noqa: E402

if not INTERPRETING:
    pytest.skip("needs TRITON_INTERPRET=1 set before pytest starts", allow_module_level=True)

from dsv3serve.moe.experts import random_experts  # noqa: E402
from dsv3serve.moe.masked_moe import masked_moe_ref, masked_moe_triton  # noqa: E402

SEED = session_seed()
RTOL = {torch.float16: 2e-3, torch.bfloat16: 2e-3, torch.float32: 1e-5}
RTOL_FP8_ROWS = 2e-2  # the intermediate goes through e4m3 on both sides; one rounding flip
# of an e4m3 value moves it by 1/16


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
        (True, torch.float16, [5, 0, 17, 32], 32, 256, 128),  # an empty and a full expert
        (True, torch.float16, [0, 0, 3], 24, 128, 256),
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


def _far_slot_stack(slots: int, h: int, inter: int, g: torch.Generator):
    """An e4m3 stack of ``slots`` experts whose last slot alone is filled: ``torch.empty``
    leaves the other slots' pages unallocated."""
    from dsv3serve.kernels.fp8_ref import FP8_DTYPE
    from dsv3serve.moe.experts import ExpertStack

    w13 = torch.empty((slots, 2 * inter, h), dtype=FP8_DTYPE)
    w2 = torch.empty((slots, h, inter), dtype=FP8_DTYPE)
    w13[-1] = torch.randn(2 * inter, h, generator=g).to(FP8_DTYPE)
    w2[-1] = torch.randn(h, inter, generator=g).to(FP8_DTYPE)
    s13 = torch.full((slots, 2 * inter // 128, h // 128), 0.02)
    s2 = torch.full((slots, h // 128, inter // 128), 0.02)
    return ExpertStack(w13, w2, s13, s2)


def test_masked_moe_addresses_slots_past_int32_offsets() -> None:
    """The last slot's w13 starts past 2**31 bytes: int32 offsets read (or fault) elsewhere.
    At DeepSeek-V3's width (w13 [4096, 7168] e4m3, 29.4 M bytes per expert) that is slot 74
    and up, and DeepEP's low-latency layout at EP2 holds 128 slots (the GPU test runs that
    width; here a narrower expert with more slots keeps the interpreter fast)."""
    g = torch.Generator().manual_seed(SEED)
    h, inter, slots = 1024, 1024, 1026
    assert (slots - 1) * 2 * inter * h > 2**31
    stack = _far_slot_stack(slots, h, inter, g)
    counts = torch.zeros(slots, dtype=torch.int32)
    counts[-1] = 2
    x = torch.zeros(slots, 2, h, dtype=torch.float16)
    x[-1] = torch.randn(2, h, generator=g).half()
    got = masked_moe_triton(x, counts, stack)[-1]
    last = stack._replace(**{k: v[-1:] for k, v in stack._asdict().items()})
    want = masked_moe_ref(x[-1:], counts[-1:], last)[0]
    assert _rel_err(got, want) < RTOL[torch.float16], f"seed {SEED}"


@pytest.mark.parametrize(("counts", "m"), [([5, 0, 17, 32], 32), ([0, 2, 0], 48)])
def test_masked_moe_takes_e4m3_rows_with_column_major_scales(counts, m) -> None:
    """DeepEP's FP8 dispatch: e4m3 rows and float32 scales [E, M, H/128] stored per expert
    as [H/128, M] (its layout); padding rows and their scales NaN. bf16 out."""
    from dsv3serve.kernels.fp8_ref import FP8_DTYPE, quant_per_token_group

    g = torch.Generator().manual_seed(SEED)
    torch.manual_seed(SEED)
    e, h, inter = len(counts), 256, 128
    stack = random_experts(e, h, inter, True, torch.bfloat16, "cpu").stack()
    q = torch.full((e, m, h), float("nan")).to(FP8_DTYPE)
    scales = torch.full((e, h // 128, m), float("nan")).transpose(1, 2)  # strides (.., 1, m)
    for i, n in enumerate(counts):
        if n:
            q[i, :n], scales[i, :n] = quant_per_token_group(torch.randn(n, h, generator=g))
    c = torch.tensor(counts, dtype=torch.int32)
    sentinel = torch.full((e, m, h), 4096.0, dtype=torch.bfloat16)
    got = masked_moe_triton(q, c, stack, out=sentinel.clone(), x_scale=scales)
    want = masked_moe_ref(q, c, stack, x_scale=scales)
    valid = torch.arange(m)[None, :] < c[:, None]
    assert got.dtype == torch.bfloat16 and bool(torch.isfinite(got[valid]).all())
    assert torch.equal(got[~valid], sentinel[~valid]), "a padding row was written"
    assert _rel_err(got[valid], want[valid]) < RTOL_FP8_ROWS, f"seed {SEED}"
