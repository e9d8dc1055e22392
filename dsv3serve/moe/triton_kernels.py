"""Triton kernels of the fused MoE: gate/up GEMM with SiLU*mul (and e4m3 quant), down GEMM,
weighted combine.

Both GEMMs walk the blocks of :mod:`dsv3serve.moe.align`: program ``(pid_m, pid_n)`` takes
the rows ``sorted_ids[pid_m * BLOCK_M:][:BLOCK_M]`` (assignments ``a = t * TOP_K + j``; the
sentinel ``num_assign`` marks padding), all routed to expert ``expert_ids[pid_m]``, and
``BLOCK_N`` rows of that expert's weight, which is ``[N, K]`` row-major inside the stack
``[E, N, K]``. Blocks at or past ``num_padded`` exit at once, so the grid can be sized on the
host without reading the routing.

Operand modes (constexpr): ``A_SCALED`` e4m3 activations with one float32 scale per (row,
128 channels) times e4m3 weights with one scale per 128x128 block (DeepSeek's
``weight_scale_inv``), applied per 128-wide K step as in :mod:`dsv3serve.kernels.fp8_gemm`;
``B_SCALED`` only: 16/32-bit activations times e4m3 weights upcast in registers; neither: both
16/32-bit. ``SWAP_AB`` computes the transposed tile so the weight rows fill the MMA's M side
when a block holds few tokens. ``ROUND``: 1 rounds intermediate values to bf16, 2 to fp16, 0
keeps float32, to follow the reference's rounding (it computes in the activation dtype).
"""

from __future__ import annotations

from dsv3serve.kernels.fp8_quant import HAS_TRITON

if HAS_TRITON:
    import triton
    import triton.language as tl


def _operand_body(base, rows, ok, offs_k, ROWS_ON_AXIS1: tl.constexpr):
    """Pointers, row mask and K index of a (rows x BLOCK_K) tile: [BLOCK_K, R] when
    ``ROWS_ON_AXIS1``, else [R, BLOCK_K]; ``rows`` are element offsets of each row's start."""
    if ROWS_ON_AXIS1:
        ptrs = base + rows[None, :] + offs_k[:, None]
        mask = ok[None, :]
        k_idx = offs_k[:, None]
    else:
        ptrs = base + rows[:, None] + offs_k[None, :]
        mask = ok[:, None]
        k_idx = offs_k[None, :]
    return ptrs, mask, k_idx


def _load_k_tile_body(ptrs, mask, k_idx, k_left, EVEN_K: tl.constexpr):
    """One K step of an operand; a mask along K only when K is not a multiple of BLOCK_K."""
    if not EVEN_K:
        mask = mask & (k_idx < k_left)
    return tl.load(ptrs, mask=mask, other=0.0)


def _mma_body(
    acc, a, b, as_ptrs, bs_ptrs, a_ok, b_ok,
    A_SCALED: tl.constexpr, B_SCALED: tl.constexpr, SWAP_AB: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    """acc += one K step of A @ B^T with its scales: acc [BM, BN] from a [BM, BK] and
    b [BK, BN], or, with SWAP_AB, acc [BN, BM] from b [BN, BK] and a [BK, BM]."""
    if A_SCALED:
        a_s = tl.load(as_ptrs, mask=a_ok, other=0.0)
        b_s = tl.load(bs_ptrs, mask=b_ok, other=0.0)
        if SWAP_AB:
            acc += tl.dot(b, a) * (b_s[:, None] * a_s[None, :])
        else:
            acc += tl.dot(a, b) * (a_s[:, None] * b_s[None, :])
    elif B_SCALED:
        b_s = tl.load(bs_ptrs, mask=b_ok, other=0.0)
        if SWAP_AB:
            acc += tl.dot(b.to(a.dtype), a, input_precision=PRECISION) * b_s[:, None]
        else:
            acc += tl.dot(a, b.to(a.dtype), input_precision=PRECISION) * b_s[None, :]
    elif SWAP_AB:
        acc = tl.dot(b, a, acc, input_precision=PRECISION)
    else:
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
    return acc


def _round_body(x, ROUND: tl.constexpr):
    """x (float32) rounded to bf16 (ROUND=1) or fp16 (2) and back; unchanged for 0."""
    if ROUND == 1:
        x = x.to(tl.bfloat16).to(tl.float32)
    elif ROUND == 2:
        x = x.to(tl.float16).to(tl.float32)
    return x


def _gate_up_body(
    a_ptr, as_ptr, w_ptr, ws_ptr, h_ptr, hs_ptr, sorted_ptr, expert_ptr, padded_ptr, num_assign,
    stride_am, stride_asm, stride_ask, stride_we, stride_wn, stride_wse, stride_wsn, stride_wsk,
    stride_hm, stride_hsm, stride_hsk,
    K: tl.constexpr, INTER: tl.constexpr, TOP_K: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SCALE_BLOCK: tl.constexpr,
    A_SCALED: tl.constexpr, B_SCALED: tl.constexpr, QUANT_OUT: tl.constexpr,
    EVEN_K: tl.constexpr, SWAP_AB: tl.constexpr, ROUND: tl.constexpr, PRECISION: tl.constexpr,
    EPS: tl.constexpr, QMAX: tl.constexpr,
):  # fmt: skip
    """h[a, n] = silu(x[t] . w13[e, n]) * (x[t] . w13[e, INTER + n]) for n in this BLOCK_N.

    a: activations [T, K] (token t = a // TOP_K), with scales [T, K/128] when A_SCALED;
    w: w13 [E, 2*INTER, K] (gate rows then up rows), scales [E, 2*INTER/128, K/128] when
    B_SCALED. The gate and up results are rounded (ROUND) as the reference's linear outputs,
    then silu and the product. With QUANT_OUT (BLOCK_N == 128) h is stored as e4m3 with one
    scale per (row, this 128-column group) in hs [M, INTER/128], ``max(amax, EPS) / QMAX`` as
    in :mod:`dsv3serve.kernels.fp8_quant`; else h [M, INTER] in h's dtype.
    """
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(padded_ptr):
        return
    assign = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    row_ok = assign < num_assign
    token = (assign // TOP_K).to(tl.int64)
    expert = tl.load(expert_ptr + pid_m).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = offs_n < INTER
    offs_k = tl.arange(0, BLOCK_K)
    w = w_ptr + expert * stride_we
    ws = ws_ptr + expert * stride_wse
    a_ptrs, a_mask, a_k = _operand(a_ptr, token * stride_am, row_ok, offs_k, SWAP_AB)
    g_rows = offs_n.to(tl.int64) * stride_wn
    u_rows = (offs_n + INTER).to(tl.int64) * stride_wn
    g_ptrs, b_mask, b_k = _operand(w, g_rows, col_ok, offs_k, not SWAP_AB)
    u_ptrs, b_mask, b_k = _operand(w, u_rows, col_ok, offs_k, not SWAP_AB)
    as_ptrs = as_ptr + token * stride_asm
    gs_ptrs = ws + (offs_n // SCALE_BLOCK) * stride_wsn
    us_ptrs = ws + ((offs_n + INTER) // SCALE_BLOCK) * stride_wsn
    if SWAP_AB:
        gate = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        up = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, (K + BLOCK_K - 1) // BLOCK_K):
        k_left = K - kb * BLOCK_K
        a = _load_k_tile(a_ptrs, a_mask, a_k, k_left, EVEN_K)
        bg = _load_k_tile(g_ptrs, b_mask, b_k, k_left, EVEN_K)
        bu = _load_k_tile(u_ptrs, b_mask, b_k, k_left, EVEN_K)
        ks = (kb * BLOCK_K) // SCALE_BLOCK
        a_s = as_ptrs + ks * stride_ask
        gate = _mma(gate, a, bg, a_s, gs_ptrs + ks * stride_wsk, row_ok, col_ok,
                    A_SCALED, B_SCALED, SWAP_AB, PRECISION)  # fmt: skip
        up = _mma(up, a, bu, a_s, us_ptrs + ks * stride_wsk, row_ok, col_ok,
                  A_SCALED, B_SCALED, SWAP_AB, PRECISION)  # fmt: skip
        a_ptrs += BLOCK_K
        g_ptrs += BLOCK_K
        u_ptrs += BLOCK_K
    if SWAP_AB:
        gate = tl.trans(gate)
        up = tl.trans(up)
    g = _round(gate, ROUND)
    h = _round(_round(g / (1.0 + tl.exp(-g)), ROUND) * _round(up, ROUND), ROUND)
    out_rows = assign.to(tl.int64)
    h_ptrs = h_ptr + out_rows[:, None] * stride_hm + offs_n[None, :]
    out_ok = row_ok[:, None] & col_ok[None, :]
    if QUANT_OUT:
        scale = tl.maximum(tl.max(tl.abs(h), axis=1), EPS) * (1.0 / QMAX)
        q = tl.minimum(tl.maximum(tl.math.div_rn(h, scale[:, None]), -QMAX), QMAX)
        tl.store(h_ptrs, q.to(h_ptr.dtype.element_ty), mask=out_ok)
        tl.store(hs_ptr + out_rows * stride_hsm + pid_n * stride_hsk, scale, mask=row_ok)
    else:
        tl.store(h_ptrs, h.to(h_ptr.dtype.element_ty), mask=out_ok)


def _down_body(
    h_ptr, hs_ptr, w_ptr, ws_ptr, y_ptr, sorted_ptr, expert_ptr, padded_ptr, num_assign,
    stride_hm, stride_hsm, stride_hsk, stride_we, stride_wn, stride_wse, stride_wsn, stride_wsk,
    stride_ym,
    K: tl.constexpr, N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, SCALE_BLOCK: tl.constexpr, A_SCALED: tl.constexpr,
    B_SCALED: tl.constexpr, EVEN_K: tl.constexpr, SWAP_AB: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    """y[a, n] = h[a] . w2[e, n] for n in this BLOCK_N (no routing weight yet).

    h: [M, K] by assignment (e4m3 with scales [M, K/128] when A_SCALED); w: w2 [E, N, K] with
    scales [E, N/128, K/128] when B_SCALED; y: [M, N] in y's dtype.
    """
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(padded_ptr):
        return
    assign = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    row_ok = assign < num_assign
    rows = assign.to(tl.int64)
    expert = tl.load(expert_ptr + pid_m).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs, a_mask, a_k = _operand(h_ptr, rows * stride_hm, row_ok, offs_k, SWAP_AB)
    w_rows = offs_n.to(tl.int64) * stride_wn
    b_ptrs, b_mask, b_k = _operand(w_ptr + expert * stride_we, w_rows, col_ok, offs_k, not SWAP_AB)
    as_ptrs = hs_ptr + rows * stride_hsm
    bs_ptrs = ws_ptr + expert * stride_wse + (offs_n // SCALE_BLOCK) * stride_wsn
    if SWAP_AB:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, (K + BLOCK_K - 1) // BLOCK_K):
        k_left = K - kb * BLOCK_K
        a = _load_k_tile(a_ptrs, a_mask, a_k, k_left, EVEN_K)
        b = _load_k_tile(b_ptrs, b_mask, b_k, k_left, EVEN_K)
        ks = (kb * BLOCK_K) // SCALE_BLOCK
        acc = _mma(acc, a, b, as_ptrs + ks * stride_hsk, bs_ptrs + ks * stride_wsk, row_ok, col_ok,
                   A_SCALED, B_SCALED, SWAP_AB, PRECISION)  # fmt: skip
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    if SWAP_AB:
        acc = tl.trans(acc)
    y_ptrs = y_ptr + rows[:, None] * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def _combine_body(
    y_ptr, w_ptr, out_ptr, stride_ym, stride_wt, stride_ot,
    N: tl.constexpr, TOP_K: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """out[t, n] = sum_j w[t, j] * y[t * TOP_K + j, n], summed in float32.

    y [T * TOP_K, N], w [T, TOP_K] float32 (already scaled by the router), out [T, N]. A row
    with weight 0 is not read: skipped assignments (negative ids) leave their y rows unwritten.
    """
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < N
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        wj = tl.load(w_ptr + t * stride_wt + j).to(tl.float32)
        live = cols < tl.where(wj != 0, N, 0)  # a zero weight reads nothing
        yj = tl.load(y_ptr + (t * TOP_K + j) * stride_ym + cols, mask=live, other=0.0)
        acc += yj.to(tl.float32) * wj
    tl.store(out_ptr + t * stride_ot + cols, acc.to(out_ptr.dtype.element_ty), mask=ok)


if HAS_TRITON:
    _operand = triton.jit(_operand_body)
    _load_k_tile = triton.jit(_load_k_tile_body)
    _mma = triton.jit(_mma_body)
    _round = triton.jit(_round_body)
    gate_up_kernel = triton.jit(_gate_up_body)
    down_kernel = triton.jit(_down_body)
    combine_kernel = triton.jit(_combine_body)
