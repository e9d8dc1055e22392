"""Shared checks for the fused add + RMSNorm + FP8 quantisation kernel against its reference
(used by the interpreter test and the GPU test).

Bounds: the residual sum is exact (both round the same float32 sum of two bf16 to bf16).
The norm differs only in float32 summation order (and ``rsqrt``'s last bit), which can move
the bf16 ``x * rstd`` by one ulp; both then multiply by the weight (|w| up to ~1.6 here) and
round again, so the norm output is within two bf16 ulps (relative 2**-6: one H100 run
found 1.08 ulps' worth of 2**-7 at row 278 of 1000) and the scales (amax / 448 of it) too.
An e4m3 value either equals the reference's bit for bit or is its neighbour in e4m3 order
(those bounds move ``x / scale`` by far less than one e4m3 step, so rounding can only pick
the other side of one boundary); everywhere, kernel and reference dequantise to within one
e4m3 step (relative 2**-3, or 2**-9 of the group's scale near zero) of each other.
"""

from __future__ import annotations

import torch

from dsv3serve.kernels.fp8_ref import dequant_per_token_group
from dsv3serve.kernels.norm_quant import NormQuantOut

BF16_ULP = 2.0**-7
NORM_BOUND = 2 * BF16_ULP  # see the docstring: one ulp before the weight, rounded again
E4M3_STEP = 2.0**-3


def e4m3_ordinal(q: torch.Tensor) -> torch.Tensor:
    """Each e4m3fn value's position in numeric order: the magnitude bits, negated for a
    negative sign (so +0 and -0 are both 0, and neighbours differ by one)."""
    code = q.view(torch.uint8).to(torch.int16)
    mag = code & 0x7F
    return torch.where(code >= 0x80, -mag, mag)


def assert_e4m3_within_one_code(q: torch.Tensor, q_ref: torch.Tensor) -> None:
    """Every e4m3 value equals the reference's or is its neighbour in numeric order. A
    count of differing entries is no bound: a scale one bf16 ulp off moves every value of
    its group, and about a quarter of them can round the other way (a 1 % bound failed
    twice on fresh seeds, 2026-11-29); a wrong value or scale lands further away."""
    gap = (e4m3_ordinal(q) - e4m3_ordinal(q_ref)).abs()
    worst = int(gap.max()) if gap.numel() else 0
    assert worst <= 1, (
        f"expected each e4m3 value within one code of the reference, got {worst} codes apart "
        f"({int((gap > 1).sum())} of {q.numel()} entries)"
    )


def random_inputs(
    m: int, h: int, with_residual: bool, device: str, g: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """x, residual (or None) and a norm weight near 1, bf16; the scale spread over rows
    makes the per-row statistics differ."""
    rows = torch.logspace(-2, 2, m, dtype=torch.float32)[:, None]
    x = (torch.randn(m, h, generator=g) * rows).to(torch.bfloat16)
    r = torch.randn(m, h, generator=g).to(torch.bfloat16) if with_residual else None
    w = (1 + 0.2 * torch.randn(h, generator=g)).to(torch.bfloat16)
    move = lambda t: None if t is None else t.to(device)  # noqa: E731
    return move(x), move(r), move(w)  # type: ignore[return-value]


def assert_matches(out: NormQuantOut, ref: NormQuantOut) -> None:
    """The kernel's outputs against the reference's, by the bounds of the module docstring."""
    assert out.q.dtype == torch.float8_e4m3fn and out.q.shape == ref.q.shape
    m = out.q.shape[0]
    assert out.scale.shape == ref.scale.shape and out.scale.stride() == (1, m)
    if ref.residual is not None:
        assert out.residual is not None and torch.equal(out.residual, ref.residual)
    if ref.normed is not None:
        assert out.normed is not None
        torch.testing.assert_close(
            out.normed.float(), ref.normed.float(), rtol=NORM_BOUND, atol=1e-30
        )
    torch.testing.assert_close(out.scale, ref.scale, rtol=NORM_BOUND, atol=1e-30)
    assert_e4m3_within_one_code(out.q, ref.q)
    deq, deq_ref = (dequant_per_token_group(o.q.cpu(), o.scale.cpu()) for o in (out, ref))
    step = ref.scale.cpu().repeat_interleave(128, 1)[:, : deq.shape[1]]
    bound = E4M3_STEP * deq_ref.abs() + step * 2.0**-9 + 1e-30
    worst = ((deq - deq_ref).abs() / bound).max().item()
    assert worst <= 1.0, f"expected dequantised values within one e4m3 step, got {worst:.2f}x"
