"""Triton kernels of the masked grouped MoE (DeepEP low-latency layout).

Activations are ``[E, M, K]``: expert ``e`` owns rows ``0 .. counts[e] - 1`` of its slab,
the rest is padding that is never loaded (row masks) nor stored. Program
``(e, pid_m, pid_n)`` computes rows ``pid_m * BLOCK_M ...`` of expert ``e`` against
``BLOCK_N`` rows of that expert's weight ``[N, K]`` (row-major inside the stack ``[E, N, K]``)
and exits at once when its first row is at or past ``counts[e]`` -- the grid is sized from
``M`` on the host, so no host sync on the counts.

``W_SCALED``: e4m3 weights with one float32 scale per 128x128 block (DeepSeek's
``weight_scale_inv`` [E, N/128, K/128]), dequantised in registers and multiplied in float32
(``BLOCK_K`` divides 128); otherwise weights and activations share a 16/32-bit dtype.
Intermediate values are rounded to the output dtype where the torch reference rounds.

Offsets are int64: ``e * stride`` of a full-width stack (128 local experts of w13
[4096, 7168] e4m3) exceeds int32, which read out of bounds (an illegal memory access in
DeepEP's low-latency path at DeepSeek-V3's width).
"""

from __future__ import annotations

from dsv3serve.kernels.fp8_quant import HAS_TRITON

if HAS_TRITON:
    import triton
    import triton.language as tl


def _weight_tile_body(
    w_ptr, ws_ptr, e, n_idx, n_ok, k_idx, k_ok, k0, stride_we, stride_wn, stride_se,
    stride_sn, W_SCALED: tl.constexpr,
):  # fmt: skip
    """[BLOCK_K, BLOCK_N] of weight rows ``n_idx`` at K offsets ``k_idx`` (zero when masked),
    dequantised to float32 when ``W_SCALED``."""
    ptrs = w_ptr + e * stride_we + n_idx[None, :] * stride_wn + k_idx[:, None]
    w = tl.load(ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
    if W_SCALED:
        s_ptrs = ws_ptr + e * stride_se + (n_idx // 128) * stride_sn + k0 // 128
        s = tl.load(s_ptrs, mask=n_ok, other=0.0)
        w = w.to(tl.float32) * s[None, :]
    return w


def _act_tile_body(
    x_ptr, e, rows, row_ok, k_idx, k_ok, stride_xe, stride_xm, W_SCALED: tl.constexpr
):
    """[BLOCK_M, BLOCK_K] of valid rows (padding rows masked to zero, never read)."""
    ptrs = x_ptr + e * stride_xe + rows[:, None] * stride_xm + k_idx[None, :]
    a = tl.load(ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
    if W_SCALED:
        a = a.to(tl.float32)
    return a


def _masked_gemm_body(
    x_ptr, w_ptr, ws_ptr, counts_ptr, out_ptr, N: tl.constexpr, K: tl.constexpr,
    stride_xe, stride_xm, stride_we, stride_wn, stride_se, stride_sn, stride_oe, stride_om,
    W_SCALED: tl.constexpr, PRECISION: tl.constexpr, GATED: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """One GEMM body for both projections, over valid rows only (``out`` [E, M, N]):

    * ``GATED`` (gate/up): ``out[e, m, n] = silu(x[e, m] . w[e, n]) * (x[e, m] . w[e, N + n])``
      with ``w`` = ``w13`` [E, 2N, K] (gate rows then up rows), both from one activation tile;
    * otherwise (down): ``out[e, m, n] = x[e, m] . w[e, n]`` with ``w`` = ``w2`` [E, N, K].
    """
    # int64 before any stride product: at DeepSeek-V3's width one expert's w13 is 29.4 M
    # bytes, so slot 74 of 128 local experts (EP2) is past 2**31 in int32 pointer math
    e = tl.program_id(0).to(tl.int64)
    pid_m, pid_n = tl.program_id(1), tl.program_id(2)
    valid = tl.load(counts_ptr + e)
    if pid_m * BLOCK_M >= valid:
        return
    rows = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    row_ok = rows < valid
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_idx = k0 + tl.arange(0, BLOCK_K)
        k_ok = k_idx < K
        a = _act_tile(x_ptr, e, rows, row_ok, k_idx, k_ok, stride_xe, stride_xm, W_SCALED)
        w = _weight_tile(
            w_ptr, ws_ptr, e, cols, col_ok, k_idx, k_ok, k0, stride_we, stride_wn, stride_se,
            stride_sn, W_SCALED,
        )  # fmt: skip
        acc = tl.dot(a, w, acc, input_precision=PRECISION)
        if GATED:
            wu = _weight_tile(
                w_ptr, ws_ptr, e, cols + N, col_ok, k_idx, k_ok, k0, stride_we, stride_wn,
                stride_se, stride_sn, W_SCALED,
            )  # fmt: skip
            acc_up = tl.dot(a, wu, acc_up, input_precision=PRECISION)
    out_dtype = out_ptr.dtype.element_ty
    if GATED:
        g = acc.to(out_dtype).to(tl.float32)
        u = acc_up.to(out_dtype).to(tl.float32)
        act = (g / (1.0 + tl.exp(-g))).to(out_dtype).to(tl.float32)
        res = (act * u).to(out_dtype)
    else:
        res = acc.to(out_dtype)
    o_ptrs = out_ptr + e * stride_oe + rows[:, None] * stride_om + cols[None, :]
    tl.store(o_ptrs, res, mask=row_ok[:, None] & col_ok[None, :])


if HAS_TRITON:
    _weight_tile = triton.jit(_weight_tile_body)
    _act_tile = triton.jit(_act_tile_body)
    masked_gemm_kernel = triton.jit(_masked_gemm_body)
