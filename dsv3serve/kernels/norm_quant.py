"""Fused residual add + RMSNorm + FP8 1x128 activation quantisation: one Triton kernel and
its torch reference.

One program per token row computes, for ``x`` [M, H] bf16 and an optional ``residual``
[M, H] bf16 (the decoder layer's ``x + sublayer(x)`` followed by the next norm):

- ``s = bf16(x + residual)`` (the residual stream; written out when a residual is given);
- ``y = weight * bf16(s * rsqrt(mean(s**2) + eps))`` in bf16, as
  :class:`dsv3serve.layers.norm.RMSNorm` (float32 statistics, weight applied after the cast);
  written out when asked (a consumer that reads bf16, such as the MoE router);
- ``q, scale = quant_per_token_group(y)``: e4m3 values [M, H] and float32 scales
  [M, ceil(H/128)] laid out M-major (strides ``(1, M)``), the layout every FP8 GEMM backend
  takes (:func:`dsv3serve.kernels.fp8_gemm.fp8_block_gemm_quantized`).

It replaces the add, the norm's five elementwise ops and reduction, and the quantisation
kernel of the GEMM that follows, with one read of ``x`` (and ``residual``) per row.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from dsv3serve.kernels.fp8_quant import HAS_TRITON, SCALE_EPS, JitKernel
from dsv3serve.kernels.fp8_ref import BLOCK, FP8_DTYPE, FP8_MAX, quant_per_token_group

if HAS_TRITON:
    import triton
    import triton.language as tl
else:  # CPU-only installs: only the reference runs
    triton = tl = None


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim: statistics in float32, cast back to ``x.dtype``, then
    ``weight *`` (the arithmetic of :class:`dsv3serve.layers.norm.RMSNorm`, which calls this)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


class NormQuantOut(NamedTuple):
    """What :func:`add_rmsnorm_quant` returns (see the module docstring for the layouts)."""

    q: torch.Tensor  # [M, H] float8_e4m3fn ([M, 0] with quantize=False)
    scale: torch.Tensor  # [M, ceil(H/128)] float32, strides (1, M) ([M, 0] unquantised)
    residual: torch.Tensor | None  # [M, H] bf16 x + residual; None without a residual
    normed: torch.Tensor | None  # [M, H] bf16 norm output; None unless asked


def _rms_normed_body(x, sum_sq, w_ptr, cols, mask, n, eps):
    """``weight * bf16(x * rsqrt(sum_sq / n + eps))`` of one row tile (float32 ``x``)."""
    var = sum_sq / n
    normed = (x * tl.math.rsqrt(var + eps)).to(w_ptr.dtype.element_ty)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    return (w.to(tl.float32) * normed.to(tl.float32)).to(w_ptr.dtype.element_ty)


def _store_fp8_groups_body(y, q_ptr, q_offs, s_ptr, s_offs, mask, smask,
                           QMAX: tl.constexpr, SEPS: tl.constexpr):  # fmt: skip
    """Store a [groups, GROUP] tile ``y`` as e4m3 with one float32 scale per group:
    ``scale = max(amax, SEPS) * fl32(1/QMAX)``, ``q = clamp(y / scale)`` (the 1x128 rule)."""
    yf = y.to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(yf), axis=1), SEPS) * (1.0 / QMAX)
    q = tl.minimum(tl.maximum(tl.math.div_rn(yf, scale[:, None]), -QMAX), QMAX)
    tl.store(q_ptr + q_offs, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + s_offs, scale, mask=smask)


def _norm_quant_body(
    x_ptr, r_ptr, w_ptr, res_out_ptr, y_ptr, q_ptr, s_ptr, M, H, eps,
    HAS_RES: tl.constexpr, WRITE_Y: tl.constexpr, QUANT: tl.constexpr, GROUPS: tl.constexpr,
    GROUP: tl.constexpr, QMAX: tl.constexpr, SEPS: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    groups = tl.arange(0, GROUPS)
    cols = groups[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    mask = cols < H
    offs = row * H + cols
    s = tl.load(x_ptr + offs, mask=mask, other=0.0)
    if HAS_RES:
        s = s.to(tl.float32) + tl.load(r_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        s = s.to(res_out_ptr.dtype.element_ty)
        tl.store(res_out_ptr + offs, s, mask=mask)
    sf = s.to(tl.float32)
    y = rms_normed(sf, tl.sum(tl.sum(sf * sf, axis=1), axis=0), w_ptr, cols, mask, H, eps)
    if WRITE_Y:
        tl.store(y_ptr + offs, y, mask=mask)
    if QUANT:
        s_offs, smask = row + groups * M, groups < tl.cdiv(H, GROUP)
        store_fp8_groups(y, q_ptr, offs, s_ptr, s_offs, mask, smask, QMAX, SEPS)


# the two row helpers are also the MLA norms' (dsv3serve.kernels.mla_norm)
rms_normed: JitKernel = triton.jit(_rms_normed_body) if HAS_TRITON else None
store_fp8_groups: JitKernel = triton.jit(_store_fp8_groups_body) if HAS_TRITON else None
_norm_quant_kernel: JitKernel = triton.jit(_norm_quant_body) if HAS_TRITON else None


def _check(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor) -> None:
    assert x.dim() == 2 and x.is_contiguous(), f"expected x [M, H] contiguous, got {x.shape}"
    assert weight.shape == (x.shape[1],), f"expected weight [{x.shape[1]}], got {weight.shape}"
    assert x.dtype == weight.dtype, f"expected x and weight of one dtype, got {x.dtype}"
    if residual is not None:
        assert residual.shape == x.shape and residual.is_contiguous(), (
            f"expected residual {tuple(x.shape)} contiguous, got {tuple(residual.shape)}"
        )
        assert residual.dtype == x.dtype, f"expected residual {x.dtype}, got {residual.dtype}"


def add_rmsnorm_quant_triton(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    write_normed: bool = False,
    quantize: bool = True,
) -> NormQuantOut:
    """The Triton kernel (any device Triton runs on, the CPU interpreter included)."""
    _check(x, residual, weight)
    m, h = x.shape
    n_groups = -(-h // BLOCK)
    q, s = _quant_outputs(m, h if quantize else 0, n_groups if quantize else 0, x.device)
    res_out = torch.empty_like(x) if residual is not None else None
    y = torch.empty_like(x) if write_normed else None
    if m > 0:
        groups = triton.next_power_of_2(n_groups)
        _norm_quant_kernel[(m,)](
            x, residual if residual is not None else x, weight,
            res_out if res_out is not None else x, y if y is not None else x, q, s, m, h, eps,
            HAS_RES=residual is not None, WRITE_Y=write_normed, QUANT=quantize,
            GROUPS=groups, GROUP=BLOCK,
            QMAX=FP8_MAX, SEPS=SCALE_EPS, num_warps=min(16, max(4, groups // 4)),
        )  # fmt: skip
    return NormQuantOut(q, s, res_out, y)


def _quant_outputs(
    m: int, h: int, n_groups: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Empty e4m3 values [m, h] and M-major scales [m, n_groups] (h = n_groups = 0: none)."""
    q = torch.empty((m, h), dtype=FP8_DTYPE, device=device)
    return q, torch.empty((n_groups, m), dtype=torch.float32, device=device).t()


def add_rmsnorm_quant_ref(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    write_normed: bool = False,
    quantize: bool = True,
) -> NormQuantOut:
    """The same outputs composed of the reference ops: the add, :func:`rms_norm_ref` (the
    model's RMSNorm) and :func:`~dsv3serve.kernels.fp8_ref.quant_per_token_group`."""
    _check(x, residual, weight)
    s = x + residual if residual is not None else x
    y = rms_norm_ref(s, weight, eps)
    if quantize:
        q, scale = quant_per_token_group(y)
        scale = scale.t().contiguous().t()  # M-major, as the kernel writes it
    else:
        q, scale = _quant_outputs(x.shape[0], 0, 0, x.device)
    return NormQuantOut(q, scale, s if residual is not None else None, y if write_normed else None)


@torch.compiler.disable  # opaque to torch.compile, as the other Triton kernels
def add_rmsnorm_quant(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    write_normed: bool = False,
    quantize: bool = True,
) -> NormQuantOut:
    """Residual add + RMSNorm + 1x128 FP8 quantisation of ``x`` [M, H] (bf16, contiguous).

    The kernel on CUDA with Triton, else the torch reference. ``residual`` [M, H] bf16 or
    None; ``weight`` [H] the norm's weight (bf16); ``write_normed`` also returns the bf16
    norm output; ``quantize=False`` skips the FP8 values and scales (a consumer that reads
    the bf16 output only, e.g. a MoE layer, which quantises per expert itself). Layouts and
    rounding: see the module docstring.
    """
    if HAS_TRITON and x.is_cuda:
        return add_rmsnorm_quant_triton(x, residual, weight, eps, write_normed, quantize)
    return add_rmsnorm_quant_ref(x, residual, weight, eps, write_normed, quantize)
