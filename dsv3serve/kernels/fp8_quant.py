"""Per-token-group (1x128) FP8 e4m3 activation quantisation: a Triton kernel and its fallback.

The kernel computes what :func:`dsv3serve.kernels.fp8_ref.quant_per_token_group` computes on
a CUDA device, bit for bit: for every row and every group of 128 channels,
``scale = max(amax, 1e-10) * fl32(1/448)`` (CUDA's torch divides by a CPU scalar by
multiplying with its float32 reciprocal; the CPU reference divides, which can differ by one
ulp), then ``q = e4m3(clamp(x / scale, -448, 448))`` with an IEEE round-to-nearest division
and a round-to-nearest-even conversion.
"""

from __future__ import annotations

from typing import Any, TypeAlias

import torch

from dsv3serve.kernels.fp8_ref import BLOCK, FP8_DTYPE, FP8_MAX, quant_per_token_group

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs have no Triton; the reference runs instead
    triton = None

HAS_TRITON = triton is not None
JitKernel: TypeAlias = Any
"""A ``triton.jit`` kernel handle (None without Triton). Triton ships no type information, so
its handles are untyped: this alias is that one gap, named once for every kernel module."""
SCALE_EPS = 1e-10  # the reference's clamp on a group's amax


def _quant_kernel_body(
    x_ptr, q_ptr, s_ptr, K, stride_xm, stride_qm, stride_sm, stride_sg,
    GROUPS: tl.constexpr, GROUP: tl.constexpr, EPS: tl.constexpr, QMAX: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    groups = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
    cols = groups[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    mask = cols < K
    x = tl.load(x_ptr + row * stride_xm + cols, mask=mask, other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(x), axis=1)
    scale = tl.maximum(amax, EPS) * (1.0 / QMAX)
    q = tl.math.div_rn(x, scale[:, None])
    q = tl.minimum(tl.maximum(q, -QMAX), QMAX)
    tl.store(q_ptr + row * stride_qm + cols, q.to(q_ptr.dtype.element_ty), mask=mask)
    n_groups = tl.cdiv(K, GROUP)
    tl.store(s_ptr + row * stride_sm + groups * stride_sg, scale, mask=groups < n_groups)


_quant_kernel: JitKernel = triton.jit(_quant_kernel_body) if HAS_TRITON else None


def _groups_per_program(m: int) -> int:
    """Small batches get one group per program (more programs), large ones four (16-byte loads)."""
    return 1 if m < 256 else 4


@torch.compiler.disable  # opaque to torch.compile: Inductor fails to re-emit our Triton kernels
def quant_per_token_group_fp8(
    x: torch.Tensor, m_major_scales: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise activations ``x`` [M, K] (bf16, fp16 or fp32, last dim contiguous) to e4m3.

    Returns ``(q [M, K] float8_e4m3fn contiguous, scale [M, ceil(K/128)] float32)``, with
    ``x ≈ q * scale`` per (row, group of 128 channels). ``m_major_scales`` lays the scales out
    with strides ``(1, M)``, the layout cuBLAS block scaling wants for the left operand.
    Without CUDA or Triton this calls the torch reference.
    """
    if not (HAS_TRITON and x.is_cuda):
        q, s = quant_per_token_group(x)
        return q, (s.t().contiguous().t() if m_major_scales else s)
    assert x.dim() == 2 and x.stride(1) == 1, f"expected x [M, K] with unit stride, got {x.shape}"
    assert x.dtype in (torch.bfloat16, torch.float16, torch.float32), f"got {x.dtype}"
    m, k = x.shape
    n_groups = -(-k // BLOCK)
    q = torch.empty((m, k), dtype=FP8_DTYPE, device=x.device)
    if m_major_scales:
        s = torch.empty((n_groups, m), dtype=torch.float32, device=x.device).t()
    else:
        s = torch.empty((m, n_groups), dtype=torch.float32, device=x.device)
    if m == 0:
        return q, s
    gpp = _groups_per_program(m)
    grid = (m, -(-n_groups // gpp))
    _quant_kernel[grid](
        x, q, s, k, x.stride(0), q.stride(0), s.stride(0), s.stride(1),
        GROUPS=gpp, GROUP=BLOCK, EPS=SCALE_EPS, QMAX=FP8_MAX, num_warps=max(1, gpp // 2),
    )  # fmt: skip
    return q, s
