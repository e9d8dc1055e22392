"""FP8 block-scaled GEMM ``y = x @ dequant(W).T``: a Triton kernel, cuBLAS, and a dispatch by M.

Operands, as DeepSeek-V3's checkpoint stores them:

- ``xq`` float8_e4m3fn [M, K] with ``xs`` float32 [M, K/128], one scale per (row, 128 channels),
  any strides (the cuBLAS path wants them M-major, strides ``(1, M)``);
- ``w`` float8_e4m3fn [N, K] row-major with ``ws`` (``weight_scale_inv``) float32
  [ceil(N/128), K/128] row-major, one scale per 128x128 block;
- output bf16 [M, N], accumulated in float32, scales applied per 128-wide K step.

The Triton kernel targets decode-sized M: a tile holds every row of the batch (M <= 64), so the
weights stream from memory once; up to M = 32 it swaps the operands (``W_tile @ x_tile.T``) so
the weight rows fill the MMA's 64-row side; split-K adds programs where the N tiles alone
cannot fill the SMs. At larger M, cuBLAS block scaling through
``torch.nn.functional.scaled_mm`` is faster. DeepGEMM (:mod:`dsv3serve.kernels.deepgemm`)
is optional: ``auto`` runs it only where this GPU's measured table
(:mod:`dsv3serve.kernels.gemm_table`) says it beat the kernel above by >= 1.05x at that
N x K and M, and only if it imports and passes its self-check.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Literal

import torch

from dsv3serve.kernels import deepgemm
from dsv3serve.kernels.fp8_quant import HAS_TRITON, JitKernel, quant_per_token_group_fp8
from dsv3serve.kernels.fp8_ref import BLOCK, FP8_DTYPE, fp8_block_linear_ref

if HAS_TRITON:
    import triton
    import triton.language as tl

Backend = Literal["auto", "triton", "cublas", "deepgemm", "torch"]
# From which M the dispatch uses cuBLAS instead of the Triton kernel, per DeepSeek-V3 weight
# (N, K): where cuBLAS beat every Triton config timed by ``dsv3serve bench kernels`` on an H100
# (docs/perf/kernels_fp8.md). For (2112, 7168) the two tie at M = 256 and cuBLAS is twice as
# fast at 1024, hence 512. Other shapes use the default.
CUBLAS_FROM_M: dict[tuple[int, int], int] = {
    (2112, 7168): 512,
    (24576, 1536): 128,
    (32768, 512): 128,
    (7168, 16384): 64,
    (36864, 7168): 64,
    (7168, 18432): 64,
}
CUBLAS_FROM_M_DEFAULT = 128
CUBLAS_M_ALIGN = 16


@dataclass(frozen=True)
class GemmConfig:
    """One launch configuration of the Triton kernel (``block_k`` is always 128)."""

    block_m: int
    block_n: int
    split_k: int
    num_warps: int
    num_stages: int
    swap_ab: bool = False


def _gemm_kernel_body(
    a_ptr, as_ptr, b_ptr, bs_ptr, c_ptr, M, N, K, k_blocks_per_split,
    stride_am, stride_asm, stride_ask, stride_bn, stride_bsn, stride_bsk,
    stride_cs, stride_cm, stride_cn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr, SWAP_AB: tl.constexpr,
):  # fmt: skip
    # SWAP_AB computes the transposed tile W_tile @ x_tile.T, so the weight rows fill the MMA's
    # M side (>= 64) and a small batch its N side; it needs EVEN_K.
    pid_m, pid_n, pid_s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m, mask_n = offs_m < M, offs_n < N
    kb_lo = pid_s * k_blocks_per_split
    kb_hi = tl.minimum(kb_lo + k_blocks_per_split, tl.cdiv(K, BLOCK_K))
    k0 = kb_lo * BLOCK_K + offs_k
    rows_a, rows_b = offs_m.to(tl.int64) * stride_am, offs_n.to(tl.int64) * stride_bn
    if SWAP_AB:
        a_ptrs, a_mask = a_ptr + rows_a[None, :] + k0[:, None], mask_m[None, :]  # [BK, BM]
        b_ptrs, b_mask = b_ptr + rows_b[:, None] + k0[None, :], mask_n[:, None]  # [BN, BK]
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        a_ptrs, a_mask = a_ptr + rows_a[:, None] + k0[None, :], mask_m[:, None]  # [BM, BK]
        b_ptrs, b_mask = b_ptr + rows_b[None, :] + k0[:, None], mask_n[None, :]  # [BK, BN]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    as_ptrs = as_ptr + offs_m * stride_asm
    bs_ptrs = bs_ptr + (offs_n // BLOCK_K) * stride_bsn
    for kb in range(kb_lo, kb_hi):
        if EVEN_K:  # a mask along K would split the loads into single bytes
            a = tl.load(a_ptrs, mask=a_mask, other=0.0)
            b = tl.load(b_ptrs, mask=b_mask, other=0.0)
        else:
            k_ok = offs_k < K - kb * BLOCK_K
            a = tl.load(a_ptrs, mask=a_mask & k_ok[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=b_mask & k_ok[:, None], other=0.0)
        a_s = tl.load(as_ptrs + kb * stride_ask, mask=mask_m, other=0.0)
        b_s = tl.load(bs_ptrs + kb * stride_bsk, mask=mask_n, other=0.0)
        if SWAP_AB:
            acc += tl.dot(b, a) * (b_s[:, None] * a_s[None, :])
        else:
            acc += tl.dot(a, b) * (a_s[:, None] * b_s[None, :])
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    c_base = c_ptr + pid_s * stride_cs
    if SWAP_AB:
        c_ptrs = c_base + offs_m[None, :] * stride_cm + offs_n[:, None] * stride_cn
        c_mask = mask_m[None, :] & mask_n[:, None]
    else:
        c_ptrs = c_base + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn
        c_mask = mask_m[:, None] & mask_n[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=c_mask)


def _splitk_reduce_body(ws_ptr, out_ptr, numel, SPLIT: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in tl.static_range(SPLIT):
        acc += tl.load(ws_ptr + s * numel + offs, mask=mask, other=0.0)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


_gemm_kernel: JitKernel = triton.jit(_gemm_kernel_body) if HAS_TRITON else None
_splitk_reduce: JitKernel = triton.jit(_splitk_reduce_body) if HAS_TRITON else None


@functools.cache
def num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _split_k(m: int, n: int, k: int, block_m: int, block_n: int, sms: int) -> int:
    """Double split-K while the grid is under two waves, each split keeps >= 8 K blocks, and the
    fp32 partials (8 bytes per output per split, written and read) stay under the weight bytes."""
    tiles = -(-m // block_m) * -(-n // block_n)
    k_blocks = -(-k // BLOCK)
    max_by_bytes = max(1, k // (8 * m))
    split = 1
    while tiles * split < 2 * sms and k_blocks // (2 * split) >= 8 and 2 * split <= max_by_bytes:
        split *= 2
    return split


def pick_config(m: int, n: int, k: int, sms: int) -> GemmConfig:
    """The launch configuration for one GEMM shape, from the sweep of ``bench kernels`` on an
    H100 (docs/perf/kernels_fp8.md): swapped operands up to M = 32 (the weight rows fill the
    MMA), 64-wide N tiles and 3 stages up to M = 256."""
    if m <= 32:
        block_m, block_n, warps, swap = (16 if m <= 16 else 32), 64, 4, k % BLOCK == 0
    elif m <= 64:
        block_m, block_n, warps, swap = 64, 64, 4, False
    else:
        block_m, block_n, warps, swap = 128, (64 if m <= 256 else 128), 8, False
    split = _split_k(m, n, k, block_m, block_n, sms)
    return GemmConfig(block_m, block_n, split, warps, 3, swap)


def _check_operands(xq: torch.Tensor, xs: torch.Tensor, w: torch.Tensor, ws: torch.Tensor) -> None:
    m, k = xq.shape
    n = w.shape[0]
    dtypes = (xq.dtype, w.dtype)
    assert dtypes == (FP8_DTYPE, FP8_DTYPE), f"expected e4m3 x and weight, got {dtypes}"
    assert w.shape == (n, k), f"expected weight of shape [N, {k}], got {list(w.shape)}"
    assert xq.stride(1) == 1 and w.stride(1) == 1, "expected unit stride along K"
    kb = -(-k // BLOCK)
    assert xs.shape == (m, kb), f"expected activation scales [{m}, {kb}], got {list(xs.shape)}"
    nb = -(-n // BLOCK)
    assert ws.shape == (nb, kb), f"expected weight scales [{nb}, {kb}], got {list(ws.shape)}"
    assert xs.dtype == ws.dtype == torch.float32, f"expected float32 scales, got {xs.dtype}"


def fp8_block_gemm_triton(
    xq: torch.Tensor,
    xs: torch.Tensor,
    w: torch.Tensor,
    ws: torch.Tensor,
    out: torch.Tensor | None = None,
    config: GemmConfig | None = None,
) -> torch.Tensor:
    """Triton FP8 block GEMM (layouts in the module docstring); ``out`` bf16 [M, N] contiguous."""
    _check_operands(xq, xs, w, ws)
    m, k = xq.shape
    n = w.shape[0]
    if out is None:
        out = torch.empty((m, n), dtype=torch.bfloat16, device=xq.device)
    assert out.shape == (m, n) and out.is_contiguous(), f"expected out [{m}, {n}] contiguous"
    if m == 0:
        return out
    cfg = config or pick_config(m, n, k, num_sms(xq.device.index or 0))
    even_k = k % BLOCK == 0
    assert even_k or not cfg.swap_ab, f"swap_ab needs K divisible by {BLOCK}, got K={k}"
    k_blocks = -(-k // BLOCK)
    per_split = -(-k_blocks // cfg.split_k)
    split = -(-k_blocks // per_split)  # no empty splits
    c = out if split == 1 else torch.empty((split, m, n), dtype=torch.float32, device=xq.device)
    stride_cs = 0 if split == 1 else c.stride(0)
    grid = (-(-m // cfg.block_m), -(-n // cfg.block_n), split)
    _gemm_kernel[grid](
        xq, xs, w, ws, c, m, n, k, per_split,
        xq.stride(0), xs.stride(0), xs.stride(1), w.stride(0), ws.stride(0), ws.stride(1),
        stride_cs, n, 1,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=BLOCK, EVEN_K=even_k,
        SWAP_AB=cfg.swap_ab, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    if split > 1:
        numel = m * n
        _splitk_reduce[(triton.cdiv(numel, 1024),)](c, out, numel, SPLIT=split, BLOCK=1024)
    return out


def cublas_supported(n: int, k: int) -> bool:
    """Weight shapes that cuBLAS 128x128 block scaling takes (N = 2112 ran on an H100).

    torch (2.11) also wants the K blocks in multiples of 4: with K = 256 it asked for a
    [4, N/128] weight scale (seen on the tiny model's hidden size). Every DeepSeek-V3
    K (512, 1536, 2048, 7168, 16384, 18432) qualifies.
    """
    return n % 16 == 0 and k % BLOCK == 0 and (k // BLOCK) % 4 == 0


def _pad_rows(xq: torch.Tensor, xs: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Append zero rows (scale 1) to reach ``rows``; scales come back M-major, strides (1, rows)."""
    m, kb = xs.shape
    if rows > m:
        pad = (0, 0, 0, rows - m)
        xq = torch.nn.functional.pad(xq.view(torch.uint8), pad).view(FP8_DTYPE)
        xs = torch.nn.functional.pad(xs, pad, value=1.0)
    if xs.stride() != (1, rows):
        m_major = torch.empty_strided((rows, kb), (1, rows), dtype=xs.dtype, device=xs.device)
        xs = m_major.copy_(xs)
    return xq, xs


def fp8_block_gemm_cublas(
    xq: torch.Tensor, xs: torch.Tensor, w: torch.Tensor, ws: torch.Tensor
) -> torch.Tensor:
    """cuBLAS block-scaled FP8 GEMM through ``torch.nn.functional.scaled_mm`` (torch >= 2.10).

    cuBLASLt has no algorithm for every M (on an H100 with CUDA 13.0, M = 7 and 255 were
    refused, 16, 64 and 256 taken), so M is padded to a multiple of ``CUBLAS_M_ALIGN``. torch
    wants ``xs`` M-major with strides exactly ``(1, M)``; ``ws.t()`` is already the
    [K/128, N/128] view with strides ``(1, K/128)`` that cuBLAS wants.
    """
    _check_operands(xq, xs, w, ws)
    m = xq.shape[0]
    xq, xs = _pad_rows(xq, xs, -(-m // CUBLAS_M_ALIGN) * CUBLAS_M_ALIGN)
    F = torch.nn.functional
    y = F.scaled_mm(
        xq, w.t(), xs, F.ScalingType.BlockWise1x128, ws.t(), F.ScalingType.BlockWise128x128,
        swizzle_a=F.SwizzleType.NO_SWIZZLE, swizzle_b=F.SwizzleType.NO_SWIZZLE,
        output_dtype=torch.bfloat16,
    )  # fmt: skip
    return y[:m]


def is_large_m(m: int, n: int, k: int) -> bool:
    """Whether M is past the decode range where the Triton kernel wins for this N x K."""
    return m >= CUBLAS_FROM_M.get((n, k), CUBLAS_FROM_M_DEFAULT)


def choose_backend(
    m: int, n: int, k: int, use_deepgemm: bool = False
) -> Literal["triton", "cublas", "deepgemm"]:
    """The GEMM the ``auto`` dispatch runs for an M x N x K problem on CUDA: DeepGEMM where
    ``use_deepgemm`` (:func:`deepgemm.dense_pick`: measured faster here, self-check passed),
    else Triton at decode M and cuBLAS from :func:`is_large_m` on."""
    if use_deepgemm and deepgemm.supported(n, k):
        return "deepgemm"
    return "cublas" if is_large_m(m, n, k) and cublas_supported(n, k) else "triton"


def fp8_block_gemm_deepgemm(
    xq: torch.Tensor, xs: torch.Tensor, w: torch.Tensor, ws: torch.Tensor
) -> torch.Tensor:
    """DeepGEMM's ``fp8_gemm_nt`` (layouts in :mod:`dsv3serve.kernels.deepgemm`); raises
    RuntimeError naming why when it did not pass its self-check on this device."""
    _check_operands(xq, xs, w, ws)
    status = deepgemm.deepgemm_status(xq.device.type, xq.device.index or 0)
    if not status.usable:
        raise RuntimeError(f"DeepGEMM backend requested but unusable: {status.reason}")
    return deepgemm.deepgemm_gemm(deepgemm.deepgemm_module(), xq, xs, w, ws)


@torch.compiler.disable  # opaque to torch.compile: Inductor fails to re-emit our Triton kernels
def fp8_block_gemm(
    x: torch.Tensor, w: torch.Tensor, w_scale_inv: torch.Tensor, backend: Backend = "auto"
) -> torch.Tensor:
    """``x @ dequant(w).T`` for bf16 ``x`` [M, K] on CUDA: quantise x per 1x128 group, then GEMM.

    ``backend="torch"``, or no CUDA tensor or no Triton, runs the float32 reference
    (:func:`fp8_block_linear_ref`), which returns ``x.dtype``; the kernels return bf16.
    """
    if backend == "torch" or not (HAS_TRITON and x.is_cuda):
        return fp8_block_linear_ref(x, w, w_scale_inv)
    m, k = x.shape
    if backend == "auto":
        n = w.shape[0]  # DeepGEMM is probed only where its table would pick it
        backend = choose_backend(m, n, k, deepgemm.dense_pick(m, n, k, x.device))
    xq, xs = quant_per_token_group_fp8(x, m_major_scales=backend in ("cublas", "deepgemm"))
    return _run_backend(backend, xq, xs, w, w_scale_inv)


@torch.compiler.disable
def fp8_block_gemm_quantized(
    xq: torch.Tensor, xs: torch.Tensor, w: torch.Tensor, w_scale_inv: torch.Tensor
) -> torch.Tensor:
    """The GEMM of :func:`fp8_block_gemm` (``auto`` backend) over activations already
    quantised on CUDA: ``xq`` [M, K] e4m3, ``xs`` [M, K/128] float32 M-major (strides
    ``(1, M)``, the layout every backend takes). Returns bf16 [M, N]."""
    m, k = xq.shape
    n = w.shape[0]
    backend = choose_backend(m, n, k, deepgemm.dense_pick(m, n, k, xq.device))
    return _run_backend(backend, xq, xs, w, w_scale_inv)


def _run_backend(
    backend: str, xq: torch.Tensor, xs: torch.Tensor, w: torch.Tensor, w_scale_inv: torch.Tensor
) -> torch.Tensor:
    if backend == "cublas":
        return fp8_block_gemm_cublas(xq, xs, w, w_scale_inv)
    if backend == "deepgemm":
        return fp8_block_gemm_deepgemm(xq, xs, w, w_scale_inv)
    return fp8_block_gemm_triton(xq, xs, w, w_scale_inv)
