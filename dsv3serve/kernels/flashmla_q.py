"""The query FlashMLA's dense decode reads, packed in one launch: a Triton kernel and its torch
reference.

Inputs, per new token ``t`` (T tokens, H heads; DeepSeek-V3: R 512, P 64, H 128):

- ``q_latent`` [T, H, R] bf16 (``q_nope`` multiplied by W_UK) and ``q_pe`` [T, H, P] bf16
  (rotated), any token and head strides, unit stride along the last dim;
- ``out_dtype``: bf16 (a bf16 pool) or e4m3 (an fp8 pool);
- ``inv_scale``: a Python float, ``1 / q_scale`` (e4m3 only).

Output: one new contiguous [T, H, R + P] tensor, row ``(t, h)`` = ``[q_latent | q_pe]``. In
bf16 the values are copied as they are; in e4m3 each is stored as
``e4m3(clamp(x * inv_scale, +-448))`` (float32 product, round to nearest even), so a value
past ``448 * q_scale`` saturates instead of becoming NaN.

It replaces ``torch.cat`` and, for e4m3, a per-tensor quantisation's several full passes
(abs, amax, divide, clamp, cast) with one read of ``q`` and one write of the packed query.
The scale is fixed (a constant of the backend), so nothing is reduced over ``q``.
"""

from __future__ import annotations

import torch

from dsv3serve.kernels.fp8_quant import HAS_TRITON, JitKernel

if HAS_TRITON:
    import triton
    import triton.language as tl
else:  # CPU-only installs: only the reference runs
    triton = tl = None

Q_FP8_MAX = 448.0  # the e4m3 range
ROWS_PER_PROGRAM = 8  # (token, head) rows per program
_OUT_DTYPES = (torch.bfloat16, torch.float8_e4m3fn)


def _pack_q_body(
    ql_ptr, qp_ptr, out_ptr, rows, H, s_lt, s_lh, s_pt, s_ph, inv_scale,
    R: tl.constexpr, P: tl.constexpr, ROWS: tl.constexpr, FP8: tl.constexpr,
    QMAX: tl.constexpr,
):  # fmt: skip
    """Grid (cdiv(T * H, ROWS),): program ``i`` packs rows ``[i * ROWS, (i + 1) * ROWS)``
    (row = t * H + h)."""
    row = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    mask = (row < rows)[:, None]
    tok, head = row // H, row % H
    cr, cp = tl.arange(0, R)[None, :], tl.arange(0, P)[None, :]
    lat = tl.load(ql_ptr + (tok * s_lt + head * s_lh)[:, None] + cr, mask=mask, other=0.0)
    pe = tl.load(qp_ptr + (tok * s_pt + head * s_ph)[:, None] + cp, mask=mask, other=0.0)
    if FP8:
        lat = tl.minimum(tl.maximum(lat.to(tl.float32) * inv_scale, -QMAX), QMAX)
        pe = tl.minimum(tl.maximum(pe.to(tl.float32) * inv_scale, -QMAX), QMAX)
    dst = out_ptr + row[:, None] * (R + P)
    ty = out_ptr.dtype.element_ty
    tl.store(dst + cr, lat.to(ty), mask=mask)
    tl.store(dst + R + cp, pe.to(ty), mask=mask)


_pack_q_kernel: JitKernel = triton.jit(_pack_q_body) if HAS_TRITON else None


def _check(q_latent: torch.Tensor, q_pe: torch.Tensor, out_dtype: torch.dtype) -> None:
    if q_latent.dim() != 3 or q_pe.dim() != 3 or q_latent.shape[:2] != q_pe.shape[:2]:
        raise ValueError(
            f"expected q_latent [T, H, R] and q_pe [T, H, P], got {list(q_latent.shape)} "
            f"and {list(q_pe.shape)}"
        )
    if q_latent.stride(-1) != 1 or q_pe.stride(-1) != 1:
        raise ValueError("expected q_latent and q_pe with unit stride along their last dim")
    if out_dtype not in _OUT_DTYPES:
        raise ValueError(f"expected an output dtype in {_OUT_DTYPES}, got {out_dtype}")


def pack_q_triton(
    q_latent: torch.Tensor, q_pe: torch.Tensor, out_dtype: torch.dtype, inv_scale: float = 1.0
) -> torch.Tensor:
    """The Triton kernel (any device Triton runs on, the CPU interpreter included); R and P
    powers of two."""
    _check(q_latent, q_pe, out_dtype)
    (t, h, r), p = q_latent.shape, q_pe.shape[-1]
    if r & (r - 1) or p & (p - 1):
        raise ValueError(f"expected power-of-two widths, got R {r} and P {p}")
    out = torch.empty(t, h, r + p, dtype=out_dtype, device=q_latent.device)
    if t * h == 0:
        return out
    fp8 = out_dtype == torch.float8_e4m3fn
    _pack_q_kernel[(triton.cdiv(t * h, ROWS_PER_PROGRAM),)](
        q_latent, q_pe, out, t * h, h, q_latent.stride(0), q_latent.stride(1),
        q_pe.stride(0), q_pe.stride(1), float(inv_scale) if fp8 else 1.0,
        R=r, P=p, ROWS=ROWS_PER_PROGRAM, FP8=fp8, QMAX=Q_FP8_MAX, num_warps=4,
    )  # fmt: skip
    return out


def pack_q_ref(
    q_latent: torch.Tensor, q_pe: torch.Tensor, out_dtype: torch.dtype, inv_scale: float = 1.0
) -> torch.Tensor:
    """The same from torch ops: the concatenation, then (e4m3) the float32 product, clamp
    and cast."""
    _check(q_latent, q_pe, out_dtype)
    q = torch.cat([q_latent, q_pe], dim=-1)
    if out_dtype != torch.float8_e4m3fn:
        return q.to(out_dtype)
    return (q.float() * inv_scale).clamp_(-Q_FP8_MAX, Q_FP8_MAX).to(out_dtype)


@torch.compiler.disable  # opaque to torch.compile, as the other Triton kernels
def pack_q(
    q_latent: torch.Tensor, q_pe: torch.Tensor, out_dtype: torch.dtype, inv_scale: float = 1.0
) -> torch.Tensor:
    """``[q_latent | q_pe]`` as one contiguous [T, H, R + P] tensor of ``out_dtype``: the
    kernel on CUDA with Triton, else the reference. See the module docstring."""
    if HAS_TRITON and q_latent.is_cuda:
        return pack_q_triton(q_latent, q_pe, out_dtype, inv_scale)
    return pack_q_ref(q_latent, q_pe, out_dtype, inv_scale)
