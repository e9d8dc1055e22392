"""Shared inputs and checks for the MLA fusion kernels against their references (the
q/kv norms of :mod:`dsv3serve.kernels.mla_norm`, the RoPE + KV-cache write of
:mod:`dsv3serve.kernels.rope_kv`), used by the interpreter and the GPU tests.

Bounds:
- norms: as the fused add + norm kernel (tests/support/norm_quant_cases.py): float32
  summation order can move ``x * rstd`` by one bf16 ulp before the weight, two after it
  (``NORM_BOUND``); each e4m3 value of the quantised q equals the reference's or is its
  neighbour, and dequantises within one e4m3 step;
- the rope key passes through bit for bit;
- RoPE: both compute ``e*c - o*s`` and ``o*c + e*s`` in float32 and round to bf16 once; a
  GPU may contract a product into an FMA, which moves the float32 result by at most an ulp
  of the larger product, so the bf16 results differ by at most one bf16 ulp of
  ``|e*c| + |o*s|`` (``ROPE_BOUND``, applied to that magnitude);
- the fp8 pool: the same division by the same scale, so the e4m3 rows and their scales are
  those of the reference over the kernel's own bf16 row (checked exactly), and the row
  itself obeys the bounds above.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from norm_quant_cases import E4M3_STEP, NORM_BOUND, assert_e4m3_within_one_code

from dsv3serve.kernels.fp8_ref import dequant_per_token_group
from dsv3serve.kernels.mla_norm import QKVNormOut

BF16_ULP = 2.0**-7
ROPE_BOUND = BF16_ULP


def qkv_inputs(
    t: int, q_dim: int, r: int, p: int, device: str, g: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A packed down-projection output [T, Q + R + P] bf16 (rows spread over four orders
    of magnitude) and the two norm weights near 1."""
    rows = torch.logspace(-2, 2, t, dtype=torch.float32)[:, None]
    packed = (torch.randn(t, q_dim + r + p, generator=g) * rows).to(torch.bfloat16)
    q_w = (1 + 0.2 * torch.randn(q_dim, generator=g)).to(torch.bfloat16)
    kv_w = (1 + 0.2 * torch.randn(r, generator=g)).to(torch.bfloat16)
    return packed.to(device), q_w.to(device), kv_w.to(device)


def poison_(t: torch.Tensor) -> torch.Tensor:
    """NaN everywhere (0xFF for e4m3, its NaN): what a kernel leaves unwritten shows."""
    if t.dtype == torch.float8_e4m3fn:
        t.view(torch.uint8).fill_(0xFF)
    elif t.is_floating_point():
        t.fill_(float("nan"))
    return t


@contextmanager
def poisoned_allocations() -> Iterator[None]:
    """Within the block every ``torch.empty`` comes back NaN-filled, so outputs a kernel
    wrapper allocates and its kernel leaves unwritten show as NaN."""
    empty = torch.empty

    def poisoned(*args: object, **kwargs: object) -> torch.Tensor:
        return poison_(empty(*args, **kwargs))

    torch.empty = poisoned  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.empty = empty


def assert_norms_match(out: QKVNormOut, ref: QKVNormOut, r: int, quantized: bool) -> None:
    """The kernel's q (values, scales) and latent against the reference's."""
    t = out.latent.shape[0]
    assert out.latent.shape == ref.latent.shape and out.latent.is_contiguous()
    assert not out.latent.isnan().any(), "latent has unwritten (NaN) entries"
    close = dict(rtol=NORM_BOUND, atol=1e-30)
    torch.testing.assert_close(out.latent[:, :r].float(), ref.latent[:, :r].float(), **close)
    assert torch.equal(out.latent[:, r:], ref.latent[:, r:]), "the rope key is not passed through"
    assert out.q.shape == ref.q.shape and out.q.dtype == ref.q.dtype
    if not quantized:
        assert out.scale.shape == (t, 0)
        torch.testing.assert_close(out.q.float(), ref.q.float(), **close)
        return
    assert out.scale.stride() == (1, t), f"expected M-major scales, got {out.scale.stride()}"
    torch.testing.assert_close(out.scale, ref.scale, **close)
    assert_e4m3_within_one_code(out.q, ref.q)
    deq, deq_ref = (dequant_per_token_group(o.q.cpu(), o.scale.cpu()) for o in (out, ref))
    assert not deq.isnan().any(), "q has unwritten (NaN) entries"
    step = ref.scale.cpu().repeat_interleave(128, 1)[:, : deq.shape[1]]
    bound = E4M3_STEP * deq_ref.abs() + step * 2.0**-9 + 1e-30
    worst = ((deq - deq_ref).abs() / bound).max().item()
    assert worst <= 1.0, f"expected dequantised q within one e4m3 step, got {worst:.2f}x"


def rope_magnitude(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``|e*c| + |o*s|`` and ``|o*c| + |e*s|`` per element of ``x`` [T, ..., D] in its
    interleaved layout: the scale of one RoPE output's rounding."""
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[-1],)
    c, s = cos.view(shape).abs(), sin.view(shape).abs()
    e, o = x.float()[..., 0::2].abs(), x.float()[..., 1::2].abs()
    return torch.stack((e * c + o * s, o * c + e * s), dim=-1).flatten(-2)


def assert_rope_close(out: torch.Tensor, ref: torch.Tensor, magnitude: torch.Tensor) -> None:
    """Within one bf16 ulp of the products' magnitude (see the module docstring)."""
    assert not out.float().isnan().any(), "RoPE output has unwritten (NaN) entries"
    err = (out.float() - ref.float()).abs()
    bound = ROPE_BOUND * magnitude + 1e-30
    worst = (err / bound).max().item()
    assert worst <= 1.0, f"expected RoPE within one bf16 ulp, got {worst:.2f}x"
