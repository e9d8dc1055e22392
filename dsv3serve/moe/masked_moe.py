"""Masked grouped MoE for DeepEP's low-latency layout: ``[E, M, H]`` rows with valid counts.

Expert ``e`` runs on ``x[e, :counts[e]]`` (unweighted: low-latency combine applies the
top-k weights); rows at or past ``counts[e]`` are padding holding stale data (NaN in the
tests) and are never read. Two implementations with one contract:

* :func:`masked_moe_ref`: torch, a loop over experts reading the counts on the host.
* :func:`masked_moe_triton`: two launches of one Triton GEMM kernel (gate/up, then down;
  :mod:`dsv3serve.moe.masked_kernels`), fixed grid, no host sync, so it can be captured
  into a CUDA graph.

Weights are the stack of :class:`~dsv3serve.moe.experts.ExpertStack`: e4m3 with 128x128
block scales, or the activation dtype. Rounding: the gate and up outputs, silu and the
product are rounded to x's dtype, as :class:`~dsv3serve.moe.ref.TorchRefMoE` does
(activations are not quantised: the e4m3 weights are dequantised and multiplied in float32).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dsv3serve.kernels.fp8_quant import HAS_TRITON
from dsv3serve.kernels.fp8_ref import BLOCK, FP8_DTYPE, dequant_weight_block
from dsv3serve.moe.experts import ExpertStack

if HAS_TRITON:
    import triton

    from dsv3serve.moe.masked_kernels import masked_gemm_kernel

BLOCK_M, BLOCK_N, BLOCK_K = 16, 64, 64


def _linear_ref(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    wf = w.float() if scale is None else dequant_weight_block(w, scale)
    return (x.float() @ wf.t()).to(x.dtype)


def masked_moe_ref(x: torch.Tensor, counts: torch.Tensor, stack: ExpertStack) -> torch.Tensor:
    """Reference: ``x`` [E, M, H], ``counts`` [E] -> [E, M, H] in x's dtype, rows at or
    past ``counts[e]`` zero. Reads the counts on the host (one sync)."""
    out = torch.zeros_like(x)
    for e, n in enumerate(counts.tolist()):
        if n == 0:
            continue
        rows = x[e, :n]
        s13 = None if stack.w13_scale_inv is None else stack.w13_scale_inv[e]
        s2 = None if stack.w2_scale_inv is None else stack.w2_scale_inv[e]
        gate, up = _linear_ref(rows, stack.w13[e], s13).chunk(2, dim=-1)
        out[e, :n] = _linear_ref(F.silu(gate) * up, stack.w2[e], s2)
    return out


def _check(x: torch.Tensor, counts: torch.Tensor, stack: ExpertStack) -> None:
    e, _, h = x.shape
    if stack.w13.shape[0] != e or stack.w13.shape[2] != h or stack.w2.shape[:2] != (e, h):
        raise ValueError(
            f"expected w13 [{e}, 2I, {h}] and w2 [{e}, {h}, I] for x {tuple(x.shape)}, got "
            f"{tuple(stack.w13.shape)} and {tuple(stack.w2.shape)}"
        )
    if counts.shape != (e,) or counts.dtype != torch.int32:
        raise ValueError(f"expected counts [{e}] int32, got {tuple(counts.shape)} {counts.dtype}")
    if x.stride(2) != 1:
        raise ValueError("expected x with contiguous rows (stride 1 along H)")
    if stack.w13.dtype != FP8_DTYPE and stack.w13.dtype != x.dtype:
        raise ValueError(f"expected e4m3 or {x.dtype} weights, got {stack.w13.dtype}")


def _launch(gated: bool, x, w, ws, counts, out, n: int, k: int) -> None:  # noqa: ANN001
    scaled = ws is not None
    s = ws if scaled else w  # a dummy pointer when unscaled (never read)
    grid = (x.shape[0], triton.cdiv(x.shape[1], BLOCK_M), triton.cdiv(n, BLOCK_N))
    masked_gemm_kernel[grid](
        x, w, s, counts, out, n, k,
        x.stride(0), x.stride(1), w.stride(0), w.stride(1),
        s.stride(0), s.stride(1), out.stride(0), out.stride(1),
        W_SCALED=scaled, PRECISION="ieee" if x.dtype == torch.float32 else "tf32", GATED=gated,
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
    )  # fmt: skip


def masked_moe_triton(
    x: torch.Tensor, counts: torch.Tensor, stack: ExpertStack, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Triton: ``x`` [E, M, H] (bf16 / fp16 / fp32), ``counts`` [E] int32 on x's device ->
    [E, M, H] in x's dtype, into ``out`` when given (a CUDA graph's static buffer). Only rows
    ``< counts[e]`` are written; the rest of ``out`` is left as it was."""
    _check(x, counts, stack)
    assert BLOCK % BLOCK_K == 0, "one weight scale per K step"
    e, m, h = x.shape
    inter = stack.w2.shape[2]
    hidden = torch.empty(e, m, inter, dtype=x.dtype, device=x.device)
    _launch(True, x, stack.w13, stack.w13_scale_inv, counts, hidden, inter, h)
    out = torch.empty_like(x) if out is None else out
    _launch(False, hidden, stack.w2, stack.w2_scale_inv, counts, out, h, inter)
    return out


def masked_moe(x: torch.Tensor, counts: torch.Tensor, stack: ExpertStack) -> torch.Tensor:
    """:func:`masked_moe_triton` on a GPU with Triton, else :func:`masked_moe_ref`; padding
    rows of the result are unspecified (the low-latency combine never reads them)."""
    if x.is_cuda and HAS_TRITON:
        return masked_moe_triton(x, counts.to(torch.int32), stack)
    return masked_moe_ref(x, counts, stack)
