"""MLA decode (weight-absorbed MQA form) over the paged latent cache: a split-KV Triton kernel.

For each query token ``t`` and head ``h`` (all heads share one latent cache, MQA)::

    s[j]   = (q_nope[t, h] . c_kv[j] + q_pe[t, h] . k_pe[j]) * sm_scale   for j < kv_len[t]
    out[t, h] = sum_j softmax(s)[j] * c_kv[j]                             (kv_lora_rank wide)

The cache rows are ``[c_kv (rank) | k_pe (rope)]``, bf16 (or any float) or e4m3 with one
float32 scale per row (the :class:`~dsv3serve.kvcache.pool.MLAKVPool` fp8 layout); e4m3 rows
are dequantised in registers (``q.float() * scale``, rounded to the query dtype as
``MLAKVPool.read`` rounds to bf16) before the dot products.

Launch shape: stage 1 runs one program per (query token, block of ``block_h`` heads, KV
split). Each program loads a KV tile once for its whole head block (``tl.dot`` of
``[block_h, rank + rope] x [rank + rope, block_n]``). Token ``t``'s KV is cut into at most
``num_splits`` splits of at least ``min_split_tokens`` (decided on the device from
``kv_len[t]``, so a CUDA graph captured for one batch size serves every context length).
A token whose KV took one split gets its output written by stage 1; otherwise stage 1
writes each split's normalised partial output and base-2 log-sum-exp, and stage 2 merges
them. Several query tokens of one sequence (speculative verify) are separate rows with
their own ``kv_len`` (bottom-right causal: query ``j`` of ``n`` sees ``kv_len - n + 1 + j``).

The oracle is :meth:`dsv3serve.attention.ref.TorchRefAttention.forward_absorbed` on the same
pool (tests: ``tests/kernels/test_mla_decode_interp.py``, ``tests/kernels/test_mla_decode_gpu.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs have no Triton; the torch reference runs instead
    triton = None

HAS_TRITON = triton is not None
LOG2E = 1.4426950408889634  # 1 / ln 2: the kernel works in base 2


@dataclass(frozen=True)
class MLADecodeConfig:
    """Launch parameters (tune with ``bench kernels --only mla``)."""

    # Best of a 2x2x2 sweep (block_h 32/64, block_n 32/64, warps 4/8) on an H200 at
    # batch 32/128 x 4K, bf16 and fp8 pools (docs/perf/hopper_h200.md), 2026-11-24.
    block_h: int = 64  # heads per program (one KV tile load serves them all)
    block_n: int = 64  # cached tokens per tile
    num_warps: int = 8  # its [64, 512] float32 accumulator
    num_stages: int = 2
    max_splits: int = 32  # KV splits per query token at most
    min_split_tokens: int = 256  # a split holds at least this many tokens
    target_programs: int = 2  # aim for this many stage-1 programs per SM


@dataclass(frozen=True)
class MLADecodeMeta:
    """Device metadata of one planned batch (all int32; fixed buffers under CUDA graphs).

    ``kv_indices`` holds page ids; query token ``t`` reads its ``kv_len[t]`` cached tokens
    from pages ``kv_indices[page_start[t]:]`` (position ``p`` at row ``p % page_size`` of
    page ``p // page_size``). ``num_splits`` is fixed per batch shape, not per context.
    """

    kv_indices: torch.Tensor  # [>= pages used] int32
    page_start: torch.Tensor  # [T] int32
    kv_len: torch.Tensor  # [T] int32
    page_size: int
    num_splits: int


def num_splits_for(num_tokens: int, num_heads: int, cfg: MLADecodeConfig, sms: int) -> int:
    """KV splits per query token so that stage 1 fills ``sms`` multiprocessors."""
    programs = num_tokens * -(-num_heads // _block_h(num_heads, cfg))
    return max(1, min(cfg.max_splits, -(-sms * cfg.target_programs // programs)))


def _block_h(num_heads: int, cfg: MLADecodeConfig) -> int:
    """At least 16 (``tl.dot``'s minimum), at most the heads rounded up to a power of 2."""
    return max(16, min(cfg.block_h, 1 << (num_heads - 1).bit_length()))


if HAS_TRITON:

    @triton.jit
    def split_bounds(kv_len, split, num_splits, min_split_tokens, BLOCK_N: tl.constexpr):
        """(splits used, first token, end token) of ``split`` for a KV of ``kv_len``."""
        n = tl.maximum(kv_len, 1)
        used = tl.minimum(tl.maximum(tl.cdiv(n, min_split_tokens), 1), num_splits)
        split_len = tl.cdiv(tl.cdiv(n, used), BLOCK_N) * BLOCK_N
        used = tl.cdiv(n, split_len)  # rounding split_len up may leave the last ones empty
        start = split * split_len
        return used, start, tl.minimum(start + split_len, kv_len)

    @triton.jit
    def _stage1_kernel(
        qn_ptr, qp_ptr, kv_ptr, sc_ptr, idx_ptr, pstart_ptr, kvlen_ptr,
        out_ptr, po_ptr, pl_ptr,
        sm_scale_log2, num_heads, num_splits, min_split_tokens,
        s_qn_t, s_qn_h, s_qp_t, s_qp_h, s_kv, s_o_t, s_o_h,
        RANK: tl.constexpr, ROPE: tl.constexpr, PAGE_SIZE: tl.constexpr,
        BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, IS_FP8: tl.constexpr,
    ):  # fmt: skip
        t, split = tl.program_id(0), tl.program_id(2)
        heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        hmask = heads < num_heads
        offs_r, offs_p = tl.arange(0, RANK), tl.arange(0, ROPE)
        kv_len = tl.load(kvlen_ptr + t)
        page0 = tl.load(pstart_ptr + t)
        used, start, end = split_bounds(kv_len, split, num_splits, min_split_tokens, BLOCK_N)
        dot_ty = qn_ptr.dtype.element_ty
        qn = tl.load(
            qn_ptr + t * s_qn_t + heads[:, None] * s_qn_h + offs_r[None, :],
            mask=hmask[:, None], other=0.0,
        )  # fmt: skip
        qp = tl.load(
            qp_ptr + t * s_qp_t + heads[:, None] * s_qp_h + offs_p[None, :],
            mask=hmask[:, None], other=0.0,
        )  # fmt: skip
        m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_H], tl.float32)
        acc = tl.zeros([BLOCK_H, RANK], tl.float32)
        for n0 in range(start, end, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            nmask = offs_n < end
            page = tl.load(idx_ptr + page0 + offs_n // PAGE_SIZE, mask=nmask, other=0)
            rows = page.to(tl.int64) * PAGE_SIZE + offs_n % PAGE_SIZE
            row_ptrs = kv_ptr + rows[:, None] * s_kv
            ckv = tl.load(row_ptrs + offs_r[None, :], mask=nmask[:, None], other=0.0)
            kpe = tl.load(row_ptrs + RANK + offs_p[None, :], mask=nmask[:, None], other=0.0)
            if IS_FP8:  # masked rows load as 0 with scale 0: never NaN
                sc = tl.load(sc_ptr + rows, mask=nmask, other=0.0)
                ckv = ckv.to(tl.float32) * sc[:, None]
                kpe = kpe.to(tl.float32) * sc[:, None]
            ckv, kpe = ckv.to(dot_ty), kpe.to(dot_ty)
            qk = tl.dot(qn, tl.trans(ckv)) + tl.dot(qp, tl.trans(kpe))
            qk = tl.where(nmask[None, :], qk * sm_scale_log2, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            p = tl.exp2(qk - m_new[:, None])
            alpha = tl.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(dot_ty), ckv)
            m_i = m_new
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        if split < used:
            if used == 1:  # the whole KV in one split: the final output
                o_ptrs = out_ptr + t * s_o_t + heads[:, None] * s_o_h + offs_r[None, :]
                tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=hmask[:, None])
            else:  # rows of the [T, H, splits] partial results, for the merge
                row = ((t * num_heads + heads) * num_splits + split).to(tl.int64)
                po_ptrs = po_ptr + row[:, None] * RANK + offs_r[None, :]
                tl.store(po_ptrs, out, mask=hmask[:, None])
                tl.store(pl_ptr + row, m_i + tl.log2(l_i), mask=hmask)

    @triton.jit
    def _merge_kernel(
        po_ptr, pl_ptr, kvlen_ptr, out_ptr, num_heads, num_splits, min_split_tokens,
        s_o_t, s_o_h, RANK: tl.constexpr, BLOCK_N: tl.constexpr,
    ):  # fmt: skip
        t, h = tl.program_id(0), tl.program_id(1)
        kv_len = tl.load(kvlen_ptr + t)
        used, _, _ = split_bounds(kv_len, 0, num_splits, min_split_tokens, BLOCK_N)
        if used > 1:
            offs_r = tl.arange(0, RANK)
            row0 = ((t * num_heads + h) * num_splits).to(tl.int64)
            m = tl.load(pl_ptr + row0)
            acc = tl.load(po_ptr + row0 * RANK + offs_r)
            denom = tl.zeros_like(m) + 1.0
            for s in range(1, used):
                lse = tl.load(pl_ptr + row0 + s)
                part = tl.load(po_ptr + (row0 + s) * RANK + offs_r)
                m_new = tl.maximum(m, lse)
                a, b = tl.exp2(m - m_new), tl.exp2(lse - m_new)
                acc = acc * a + part * b
                denom = denom * a + b
                m = m_new
            o_ptrs = out_ptr + t * s_o_t + h * s_o_h + offs_r
            tl.store(o_ptrs, (acc / denom).to(out_ptr.dtype.element_ty))


def _check(q_nope: torch.Tensor, q_pe: torch.Tensor, kv: torch.Tensor, meta: MLADecodeMeta):
    t, h, rank = q_nope.shape
    rope = q_pe.shape[-1]
    if list(q_pe.shape[:2]) != [t, h] or kv.shape[-1] != rank + rope:
        raise ValueError(
            f"expected q_nope [T, H, R], q_pe [T, H, P] and KV rows of R + P; got "
            f"{list(q_nope.shape)}, {list(q_pe.shape)}, {list(kv.shape)}"
        )
    for name, n in (("kv_lora_rank", rank), ("rope dim", rope)):
        if n < 16 or n & (n - 1):
            raise ValueError(f"{name}: expected a power of two >= 16, got {n}")
    if q_nope.stride(-1) != 1 or q_pe.stride(-1) != 1 or kv.stride(-1) != 1:
        raise ValueError("q_nope, q_pe and the KV buffer need a contiguous last dimension")
    if meta.kv_len.shape[0] != t or meta.page_start.shape[0] != t:
        raise ValueError(f"metadata for {meta.kv_len.shape[0]} query tokens, got {t}")


@torch.compiler.disable  # opaque to torch.compile: Inductor fails to re-emit our Triton kernels
def mla_decode(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    kv_buffer: torch.Tensor,
    kv_scale: torch.Tensor | None,
    meta: MLADecodeMeta,
    sm_scale: float,
    cfg: MLADecodeConfig | None = None,
) -> torch.Tensor:
    """Absorbed MLA attention of ``T`` query tokens over the paged latent cache.

    ``q_nope`` [T, H, R] (already multiplied by W_UK) and ``q_pe`` [T, H, P], bf16 or fp16
    (the dot dtype); ``kv_buffer`` [num_pages, page_size, R + P] (pages contiguous), bf16 /
    fp16 / float32, or float8_e4m3fn with ``kv_scale`` [num_pages, page_size] float32.
    Returns [T, H, R] in q's dtype. No host sync: safe to capture in a CUDA graph.
    """
    if not HAS_TRITON:
        raise RuntimeError("mla_decode needs Triton (pip install 'dsv3serve[gpu]')")
    cfg = cfg or MLADecodeConfig()
    _check(q_nope, q_pe, kv_buffer, meta)
    is_fp8 = kv_buffer.dtype == torch.float8_e4m3fn
    if is_fp8 and kv_scale is None:
        raise ValueError("an e4m3 KV buffer needs its float32 per-row kv_scale")
    t, h, rank = q_nope.shape
    block_h, splits = _block_h(h, cfg), meta.num_splits
    out = torch.empty_like(q_nope)
    n_part = t * h * splits if splits > 1 else 1  # one split: stage 1 writes ``out`` itself
    part = torch.empty(n_part, rank, dtype=torch.float32, device=q_nope.device)
    lse = torch.empty(n_part, dtype=torch.float32, device=q_nope.device)
    rows = kv_buffer.view(-1, kv_buffer.shape[-1])
    _stage1_kernel[(t, triton.cdiv(h, block_h), splits)](
        q_nope, q_pe, rows, kv_scale if is_fp8 else rows, meta.kv_indices, meta.page_start,
        meta.kv_len, out, part, lse, sm_scale * LOG2E, h, splits, cfg.min_split_tokens,
        q_nope.stride(0), q_nope.stride(1), q_pe.stride(0), q_pe.stride(1), rows.stride(0),
        out.stride(0), out.stride(1), RANK=rank, ROPE=q_pe.shape[-1],
        PAGE_SIZE=meta.page_size, BLOCK_H=block_h, BLOCK_N=cfg.block_n, IS_FP8=is_fp8,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    if splits > 1:
        merge_splits(part, lse, meta.kv_len, out, splits, cfg.min_split_tokens, cfg.block_n)
    return out


def merge_splits(
    part: torch.Tensor,
    lse: torch.Tensor,
    kv_len: torch.Tensor,
    out: torch.Tensor,
    num_splits: int,
    min_split_tokens: int,
    block_n: int,
) -> None:
    """Stage 2: merge the per-split results into ``out`` [T, H, R] (tokens whose KV took
    several splits; ``split_bounds`` with the same arguments says how many).

    ``part`` [T * H * num_splits, R] float32 holds each split's normalised output, row
    ``(t * H + h) * num_splits + split``; ``lse`` [same rows] its base-2 log-sum-exp.
    """
    t, h, rank = out.shape
    _merge_kernel[(t, h)](
        part, lse, kv_len, out, h, num_splits, min_split_tokens,
        out.stride(0), out.stride(1), RANK=rank, BLOCK_N=block_n, num_warps=4,
    )  # fmt: skip


def decode_bytes(kv_tokens: int, kv_row_bytes: int, q: torch.Tensor, rank: int) -> int:
    """Bytes a decode call must move at least: cached rows (scales included), q and out."""
    t, h = q.shape[:2]
    return kv_tokens * kv_row_bytes + q.numel() * q.element_size() + t * h * rank * 2
