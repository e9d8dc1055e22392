"""MLA decode over the fp8 pool with FP8 tensor-core math (the e4m3 rows are never dequantised).

The same attention as :func:`dsv3serve.kernels.mla_decode.mla_decode` (weight-absorbed MQA
form; ``s[j] = (q_nope . c_kv[j] + q_pe . k_pe[j]) * sm_scale``, ``out = softmax(s) @ c_kv``)
over the :class:`~dsv3serve.kvcache.pool.MLAKVPool` fp8 layout: row ``j`` holds ``c_kv[j] |
k_pe[j]`` as e4m3 ``x / ks[j]`` with one float32 scale ``ks[j]`` per token. Where the older
kernel converts each row to bf16 in registers, this one feeds the e4m3 rows to both products:

1. ``_quant_q_kernel`` quantises q per (token, head) over its 576 values:
   ``q8 = q / qs``, ``qs = max|q| / 448``.
2. ``_stage1_kernel``, per tile of ``BLOCK_N`` cached tokens:
   ``S = (q8 . k8^T) * qs[h] * ks[j] * sm_scale`` (FP8 dots, float32 accumulate), online
   softmax in base 2, then ``P' = p * ks[j] / c`` with ``c = max(ks over the tile) / 448``,
   rounded to e4m3 (``P'`` in [0, 448]: ``p`` <= 1 and ``ks[j] / c`` <= 448), and
   ``acc += P' . v8`` as an FP8 dot over the same e4m3 rows (``V = c_kv``, the first 512
   values). The tile's ``c`` differs from the last tile's ``C``, so ``acc`` is kept in units
   of the last ``c`` (``acc_true = acc * C``): the per-row rescale ``alpha`` becomes
   ``alpha * C / c``, no extra pass over the accumulator.
3. KV splits and their merge as in :mod:`dsv3serve.kernels.mla_decode` (the same
   ``split_bounds`` and merge kernel, so one plan serves both kernels' metadata); the
   number of splits comes from :func:`fp8_num_splits` (fewest splits for the fullest waves).

Error: e4m3 keeps 4 significant bits, so the rounding of q and of P adds a relative error
of ~2^-5 rms per element on top of the cache's own (the tests name the bound).

Oracle: :func:`dsv3serve.kernels.mla_decode_ref.mla_decode_ref` (float32 on the dequantised
cache). Tests: ``tests/kernels/test_mla_decode_fp8_interp.py`` (CPU, Triton's interpreter) and
``tests/kernels/test_mla_decode_fp8_gpu.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dsv3serve.kernels.mla_decode import HAS_TRITON, LOG2E, MLADecodeMeta, merge_splits

if HAS_TRITON:
    import triton
    import triton.language as tl

    from dsv3serve.kernels.mla_decode import split_bounds

FP8_MAX = 448.0
MIN_SCALE = 1e-12  # q rows of zeros (padded heads) keep a finite scale
QUANT_BLOCK_H = 16  # heads per program of the q quantisation
FULL_WAVES = 0.85  # programs / (waves * slots) that counts as filling the GPU


@dataclass(frozen=True)
class FP8MLAConfig:
    """Launch parameters (sweep with ``bench kernels --only mla``; bench/kernels/mla.py).

    Default: 64 heads x 32 tokens a tile, 4 warps, the 512 output columns in two
    programs: 241 registers, no spills, 82 KB of shared memory (ptxas, sm_90a, triton
    3.6), so two programs fit an SM. Not yet timed against the other configs.
    """

    block_h: int = 64  # heads per program: the M of both dots (one Hopper warpgroup MMA is 64)
    block_n: int = 32  # cached tokens per tile: N of QK^T, K of PV (a multiple of 32)
    num_warps: int = 4
    num_stages: int = 2
    dv_split: int = 2  # programs sharing one head block's 512 output columns (1 or 2)
    prefetch: bool = False  # one register-prefetched load per tile (dv_split 1 only)
    max_splits: int = 32
    min_split_tokens: int = 128  # a split holds at least this many tokens
    ctas_per_sm: int = 2  # resident programs per SM, for the split count


def fp8_num_splits(num_tokens: int, num_heads: int, cfg: FP8MLAConfig, sms: int) -> int:
    """KV splits per query token: the fewest whose programs fill their waves.

    ``num_tokens * head blocks * dv_split`` programs per split run ``sms * ctas_per_sm``
    at a time. Each split costs a float32 partial output (2 KB per head, written and read
    back), so the count is the smallest whose last wave is at least ``FULL_WAVES`` full;
    failing that (a few tokens), as many as one wave holds. E.g. on 132 SMs x 2 with 128
    heads: 64 or 128 tokens 1 split, 32 tokens 2, 16 tokens 4, 1 token 32 (``max_splits``).
    """
    per_split = num_tokens * -(-num_heads // cfg.block_h) * cfg.dv_split
    slots = sms * cfg.ctas_per_sm

    def fill(s: int) -> float:
        return per_split * s / (-(-per_split * s // slots) * slots)

    full = [s for s in range(1, cfg.max_splits + 1) if fill(s) >= FULL_WAVES]
    return full[0] if full else max(1, min(cfg.max_splits, slots // per_split))


if HAS_TRITON:
    _FP8_MAX = tl.constexpr(FP8_MAX)  # globals a kernel reads must be constexpr
    _MIN_SCALE = tl.constexpr(MIN_SCALE)

    @triton.jit
    def _quant_q_kernel(
        qn_ptr, qp_ptr, q8_ptr, qs_ptr, num_heads, s_qn_t, s_qn_h, s_qp_t, s_qp_h,
        RANK: tl.constexpr, ROPE: tl.constexpr, BLOCK_H: tl.constexpr,
    ):  # fmt: skip
        """q_nope [T, H, R] and q_pe [T, H, P] (any float) -> q8 [T, H, R + P] e4m3
        (contiguous) and qs [T, H] float32, one scale per (token, head) row."""
        t = tl.program_id(0)
        heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        hmask = heads < num_heads
        offs_r, offs_p = tl.arange(0, RANK), tl.arange(0, ROPE)
        qn_ptrs = qn_ptr + t * s_qn_t + heads[:, None] * s_qn_h + offs_r[None, :]
        qp_ptrs = qp_ptr + t * s_qp_t + heads[:, None] * s_qp_h + offs_p[None, :]
        qn = tl.load(qn_ptrs, mask=hmask[:, None], other=0.0).to(tl.float32)
        qp = tl.load(qp_ptrs, mask=hmask[:, None], other=0.0).to(tl.float32)
        amax = tl.maximum(tl.max(tl.abs(qn), 1), tl.max(tl.abs(qp), 1))
        scale = tl.maximum(amax / _FP8_MAX, _MIN_SCALE)
        inv = 1.0 / scale
        row = (t * num_heads + heads).to(tl.int64)
        q8_row = q8_ptr + row[:, None] * (RANK + ROPE)
        qn8 = tl.minimum(tl.maximum(qn * inv[:, None], -_FP8_MAX), _FP8_MAX)
        qp8 = tl.minimum(tl.maximum(qp * inv[:, None], -_FP8_MAX), _FP8_MAX)
        tl.store(q8_row + offs_r[None, :], qn8.to(tl.float8e4nv), mask=hmask[:, None])
        tl.store(q8_row + RANK + offs_p[None, :], qp8.to(tl.float8e4nv), mask=hmask[:, None])
        tl.store(qs_ptr + row, scale, mask=hmask)

    @triton.jit
    def _tile_rows(idx_ptr, page0, n0, end, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr):
        """Cache rows (int64) of tokens ``[n0, n0 + BLOCK_N)`` and which are ``< end``."""
        offs_n = n0 + tl.arange(0, BLOCK_N)
        nmask = offs_n < end
        page = tl.load(idx_ptr + page0 + offs_n // PAGE_SIZE, mask=nmask, other=0)
        return page.to(tl.int64) * PAGE_SIZE + offs_n % PAGE_SIZE, nmask

    @triton.jit
    def _rope_offsets(ROPE: tl.constexpr):
        """Rope columns padded to the FP8 dot's K minimum (32), and which are real."""
        ROPE_PAD: tl.constexpr = ROPE if ROPE >= 32 else 32
        offs = tl.arange(0, ROPE_PAD)
        return offs, offs < ROPE

    @triton.jit
    def _load_tile(kv_ptr, ks_ptr, rows, nmask, s_kv, RANK: tl.constexpr, ROPE: tl.constexpr):
        """A tile's e4m3 c_kv [BLOCK_N, RANK], k_pe [BLOCK_N, max(ROPE, 32)] and float32
        scales; masked rows (and rope padding) load as 0, scales too: never NaN."""
        row_ptrs = kv_ptr + rows[:, None] * s_kv
        ckv = tl.load(row_ptrs + tl.arange(0, RANK)[None, :], mask=nmask[:, None], other=0.0)
        offs_p, pmask = _rope_offsets(ROPE)
        kpe_mask = nmask[:, None] & pmask[None, :]
        kpe = tl.load(row_ptrs + RANK + offs_p[None, :], mask=kpe_mask, other=0.0)
        return ckv, kpe, tl.load(ks_ptr + rows, mask=nmask, other=0.0)

    @triton.jit
    def _scores(qn, qp, q_scale, ckv, kpe, ks, nmask):
        """Base-2 scores [BLOCK_H, BLOCK_N]: FP8 dots, then q's and K's scales."""
        qk = tl.dot(qp, tl.trans(kpe), tl.dot(qn, tl.trans(ckv)))
        qk = qk * q_scale[:, None] * ks[None, :]
        return tl.where(nmask[None, :], qk, float("-inf"))

    @triton.jit
    def _softmax_pv(qk, ks, v, m_i, l_i, acc, acc_scale):
        """Online-softmax update and ``acc += P' . v`` (``v`` [BLOCK_N, DV] e4m3).

        ``P' = p * ks / c`` in e4m3, ``c = max(ks) / 448``; ``acc`` stays in units of
        ``acc_scale`` (the last tile's ``c``): the true accumulator is ``acc * acc_scale``.
        """
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        p = tl.exp2(qk - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v_scale = tl.maximum(tl.max(ks, 0), _MIN_SCALE) / _FP8_MAX
        p8 = tl.minimum(p * (ks / v_scale)[None, :], _FP8_MAX).to(tl.float8e4nv)
        acc = acc * (alpha * acc_scale / v_scale)[:, None]
        acc = tl.dot(p8, v, acc)
        return m_new, l_i, acc, tl.zeros_like(acc_scale) + v_scale

    @triton.jit
    def _loop_reload(
        qn, qp, q_scale, kv_ptr, ks_ptr, idx_ptr, page0, start, end, s_kv, offs_v,
        RANK: tl.constexpr, ROPE: tl.constexpr, PAGE_SIZE: tl.constexpr,
        BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, DV: tl.constexpr,
    ):  # fmt: skip
        """The KV loop, PV operand re-loaded: K tiles pipelined by Triton (cp.async); the
        PV operand (columns ``offs_v``) a second load of the same rows, from L2, which
        Triton transposes through registers (one load feeding both operand layouts would
        not be pipelined)."""
        m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_H], tl.float32)
        acc_scale = tl.full([BLOCK_H], 1.0, tl.float32)
        acc = tl.zeros([BLOCK_H, DV], tl.float32)
        for n0 in range(start, end, BLOCK_N):
            rows, nmask = _tile_rows(idx_ptr, page0, n0, end, PAGE_SIZE, BLOCK_N)
            ckv, kpe, ks = _load_tile(kv_ptr, ks_ptr, rows, nmask, s_kv, RANK, ROPE)
            v_t = tl.load(  # [DV, BLOCK_N], issued before QK^T so that it lands meanwhile
                kv_ptr + rows[None, :] * s_kv + offs_v[:, None], mask=nmask[None, :], other=0.0
            )
            qk = _scores(qn, qp, q_scale, ckv, kpe, ks, nmask)
            m_i, l_i, acc, acc_scale = _softmax_pv(qk, ks, tl.trans(v_t), m_i, l_i, acc, acc_scale)
        return m_i, l_i, acc, acc_scale

    @triton.jit
    def _loop_prefetch(
        qn, qp, q_scale, kv_ptr, ks_ptr, idx_ptr, page0, start, end, s_kv,
        RANK: tl.constexpr, ROPE: tl.constexpr, PAGE_SIZE: tl.constexpr,
        BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    ):  # fmt: skip
        """The KV loop, one load per tile: the next tile is loaded into registers while
        this one computes (by hand: Triton does not pipeline a load that feeds two
        operand layouts), and both operand copies are written from those registers. Half
        the L2 traffic of ``_loop_reload``, ~18 more registers a thread (BLOCK_N 32, 8
        warps). Needs the whole row per program (DV_SPLIT 1)."""
        m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_H], tl.float32)
        acc_scale = tl.full([BLOCK_H], 1.0, tl.float32)
        acc = tl.zeros([BLOCK_H, RANK], tl.float32)
        rows, nmask = _tile_rows(idx_ptr, page0, start, end, PAGE_SIZE, BLOCK_N)
        ckv, kpe, ks = _load_tile(kv_ptr, ks_ptr, rows, nmask, s_kv, RANK, ROPE)
        for n0 in range(start, end, BLOCK_N):
            rows, nmask_next = _tile_rows(idx_ptr, page0, n0 + BLOCK_N, end, PAGE_SIZE, BLOCK_N)
            ckv_next, kpe_next, ks_next = _load_tile(
                kv_ptr, ks_ptr, rows, nmask_next, s_kv, RANK, ROPE
            )
            qk = _scores(qn, qp, q_scale, ckv, kpe, ks, nmask)
            m_i, l_i, acc, acc_scale = _softmax_pv(qk, ks, ckv, m_i, l_i, acc, acc_scale)
            ckv, kpe, ks, nmask = ckv_next, kpe_next, ks_next, nmask_next
        return m_i, l_i, acc, acc_scale

    @triton.jit
    def _stage1_kernel(
        q8_ptr, qs_ptr, kv_ptr, ks_ptr, idx_ptr, pstart_ptr, kvlen_ptr,
        out_ptr, po_ptr, pl_ptr,
        sm_scale_log2, num_heads, num_splits, min_split_tokens, s_kv, s_o_t, s_o_h,
        RANK: tl.constexpr, ROPE: tl.constexpr, PAGE_SIZE: tl.constexpr,
        BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, DV_SPLIT: tl.constexpr,
        PREFETCH: tl.constexpr,
    ):  # fmt: skip
        """One program: ``BLOCK_H`` heads of query token ``t`` over KV split ``split``,
        output columns ``[c * DV, (c + 1) * DV)`` with ``DV = RANK / DV_SPLIT``.

        Grid ``(head blocks * DV_SPLIT, T, splits)``: the programs sharing one (token,
        split) are neighbours in launch order, so they run together and all but the first
        read its KV tiles from L2. Layouts: ``q8`` [T, H, R + P] e4m3 and ``qs`` [T, H]
        float32 (``_quant_q_kernel``); ``kv`` [slots, R + P] e4m3 rows (row stride
        ``s_kv``), ``ks`` [slots] float32; ``out`` [T, H, R]; ``po`` / ``pl`` as in
        ``merge_splits``.

        Registers. The float32 accumulator [BLOCK_H, DV] sets them: [64, 512] is 32K
        values, 128 a thread at 8 warps (two warpgroups, each MMA-ing 256 columns), and
        [64, 256] (DV_SPLIT 2) the same at 4 warps. All 128 heads in one program ([128,
        512], 256 a thread) cannot fit, hence BLOCK_H 64 and neighbouring programs.
        Triton gives a dot whose result feeds another dot (QK^T -> P -> PV) all its warps
        along M, so at 8 warps and M = 64 both warpgroups compute the same QK^T tile;
        DV_SPLIT 2 at 4 warps does that work in two programs instead, two resident per
        SM (one's softmax can overlap the other's MMAs). Scores, probabilities and the PV
        operand of a [64, 32] tile add ~40 registers. ptxas (sm_90a, triton 3.6, checked
        on a CPU): 64 / 32 / 4 warps / DV_SPLIT 2 uses 241 registers and 82 KB of shared
        memory, 64 / 32 / 8 warps 247 registers; no spills. BLOCK_N 64 and PREFETCH spill
        (80-230 bytes). q8 is loaded from memory, not computed here, so that Triton keeps
        the A operand of QK^T in shared memory (36 KB), not in registers.

        FP8 MMAs need both operands K-major. The K rows are, for QK^T, as stored; for PV
        the tile must be transposed, which Triton does through registers. ``PREFETCH``
        picks how the tile gets there (``_loop_reload`` or ``_loop_prefetch``).
        """
        pid0, t, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        heads = (pid0 // DV_SPLIT) * BLOCK_H + tl.arange(0, BLOCK_H)
        chunk = pid0 % DV_SPLIT
        DV: tl.constexpr = RANK // DV_SPLIT
        hmask = heads < num_heads
        offs_r = tl.arange(0, RANK)
        offs_p, pmask = _rope_offsets(ROPE)
        offs_v = chunk * DV + tl.arange(0, DV)  # this program's output columns
        kv_len = tl.load(kvlen_ptr + t)
        page0 = tl.load(pstart_ptr + t)
        used, start, end = split_bounds(kv_len, split, num_splits, min_split_tokens, BLOCK_N)
        row = (t * num_heads + heads).to(tl.int64)
        q8_row = q8_ptr + row[:, None] * (RANK + ROPE)
        qn = tl.load(q8_row + offs_r[None, :], mask=hmask[:, None], other=0.0)
        qp_mask = hmask[:, None] & pmask[None, :]
        qp = tl.load(q8_row + RANK + offs_p[None, :], mask=qp_mask, other=0.0)
        q_scale = tl.load(qs_ptr + row, mask=hmask, other=0.0) * sm_scale_log2
        if PREFETCH:
            m_i, l_i, acc, acc_scale = _loop_prefetch(
                qn, qp, q_scale, kv_ptr, ks_ptr, idx_ptr, page0, start, end, s_kv,
                RANK, ROPE, PAGE_SIZE, BLOCK_H, BLOCK_N,
            )  # fmt: skip
        else:
            m_i, l_i, acc, acc_scale = _loop_reload(
                qn, qp, q_scale, kv_ptr, ks_ptr, idx_ptr, page0, start, end, s_kv, offs_v,
                RANK, ROPE, PAGE_SIZE, BLOCK_H, BLOCK_N, DV,
            )  # fmt: skip
        out = acc * (acc_scale / tl.where(l_i > 0, l_i, 1.0))[:, None]
        if split < used:
            if used == 1:  # the whole KV in one split: the final output
                o_ptrs = out_ptr + t * s_o_t + heads[:, None] * s_o_h + offs_v[None, :]
                tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=hmask[:, None])
            else:  # rows of the [T, H, splits] partial results, for the merge
                prow = row * num_splits + split
                po_ptrs = po_ptr + prow[:, None] * RANK + offs_v[None, :]
                tl.store(po_ptrs, out, mask=hmask[:, None])
                tl.store(pl_ptr + prow, m_i + tl.log2(l_i), mask=hmask & (chunk == 0))


def _check(
    q_nope: torch.Tensor, q_pe: torch.Tensor, kv: torch.Tensor, scale: torch.Tensor | None
) -> None:
    t, h, rank = q_nope.shape
    rope = q_pe.shape[-1]
    if list(q_pe.shape[:2]) != [t, h] or kv.shape[-1] != rank + rope:
        raise ValueError(
            f"expected q_nope [T, H, R], q_pe [T, H, P] and KV rows of R + P; got "
            f"{list(q_nope.shape)}, {list(q_pe.shape)}, {list(kv.shape)}"
        )
    for name, n, least in (("kv_lora_rank", rank, 32), ("rope dim", rope, 1)):
        if n < least or n & (n - 1):
            raise ValueError(f"{name}: expected a power of two >= {least}, got {n}")
    if kv.dtype != torch.float8_e4m3fn or scale is None or scale.dtype != torch.float32:
        raise ValueError(
            f"expected an e4m3 KV buffer and its float32 per-row scales, got {kv.dtype} and "
            f"{None if scale is None else scale.dtype}"
        )
    if q_nope.stride(-1) != 1 or q_pe.stride(-1) != 1 or kv.stride(-1) != 1:
        raise ValueError("q_nope, q_pe and the KV buffer need a contiguous last dimension")


def _check_config(cfg: FP8MLAConfig) -> None:
    for name in ("block_h", "block_n"):
        n = getattr(cfg, name)
        if n < 16 or n & (n - 1):
            raise ValueError(f"FP8MLAConfig.{name}: expected a power of two >= 16, got {n}")
    if cfg.dv_split not in (1, 2):
        raise ValueError(f"FP8MLAConfig.dv_split: expected 1 or 2, got {cfg.dv_split}")
    if cfg.prefetch and cfg.dv_split != 1:
        raise ValueError("FP8MLAConfig.prefetch needs dv_split 1 (the whole row per program)")
    if cfg.block_n % 32:
        raise ValueError(
            f"FP8MLAConfig.block_n: the PV dot's K (multiple of 32), got {cfg.block_n}"
        )


def quantize_q(q_nope: torch.Tensor, q_pe: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q8 [T, H, R + P] e4m3 and its per-(token, head) float32 scales [T, H]."""
    t, h, rank = q_nope.shape
    rope = q_pe.shape[-1]
    q8 = torch.empty(t, h, rank + rope, dtype=torch.float8_e4m3fn, device=q_nope.device)
    qs = torch.empty(t, h, dtype=torch.float32, device=q_nope.device)
    _quant_q_kernel[(t, triton.cdiv(h, QUANT_BLOCK_H))](
        q_nope, q_pe, q8, qs, h, q_nope.stride(0), q_nope.stride(1), q_pe.stride(0),
        q_pe.stride(1), RANK=rank, ROPE=rope, BLOCK_H=QUANT_BLOCK_H, num_warps=4,
    )  # fmt: skip
    return q8, qs


@torch.compiler.disable  # opaque to torch.compile: Inductor fails to re-emit our Triton kernels
def mla_decode_fp8(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    kv_buffer: torch.Tensor,
    kv_scale: torch.Tensor | None,
    meta: MLADecodeMeta,
    sm_scale: float,
    cfg: FP8MLAConfig | None = None,
) -> torch.Tensor:
    """Absorbed MLA attention of ``T`` query tokens over the fp8 paged latent cache.

    ``q_nope`` [T, H, R] (already multiplied by W_UK) and ``q_pe`` [T, H, P], bf16 / fp16 /
    float32 (quantised to e4m3 here); ``kv_buffer`` [num_pages, page_size, R + P]
    float8_e4m3fn with ``kv_scale`` [num_pages, page_size] float32; ``meta`` as for
    :func:`~dsv3serve.kernels.mla_decode.mla_decode` (``num_splits`` from
    :func:`fp8_num_splits`). Returns [T, H, R] in q_nope's dtype. No host sync: safe to
    capture in a CUDA graph.
    """
    if not HAS_TRITON:
        raise RuntimeError("mla_decode_fp8 needs Triton (pip install 'dsv3serve[gpu]')")
    cfg = cfg or FP8MLAConfig()
    _check(q_nope, q_pe, kv_buffer, kv_scale)
    _check_config(cfg)
    t, h, rank = q_nope.shape
    if meta.kv_len.shape[0] != t or meta.page_start.shape[0] != t:
        raise ValueError(f"metadata for {meta.kv_len.shape[0]} query tokens, got {t}")
    q8, qs = quantize_q(q_nope, q_pe)
    splits, block_h = meta.num_splits, cfg.block_h
    out = torch.empty_like(q_nope)
    n_part = t * h * splits if splits > 1 else 1  # one split: stage 1 writes ``out`` itself
    part = torch.empty(n_part, rank, dtype=torch.float32, device=q_nope.device)
    lse = torch.empty(n_part, dtype=torch.float32, device=q_nope.device)
    rows = kv_buffer.view(-1, kv_buffer.shape[-1])
    _stage1_kernel[(triton.cdiv(h, block_h) * cfg.dv_split, t, splits)](
        q8, qs, rows, kv_scale, meta.kv_indices, meta.page_start, meta.kv_len, out, part, lse,
        sm_scale * LOG2E, h, splits, cfg.min_split_tokens, rows.stride(0), out.stride(0),
        out.stride(1), RANK=rank, ROPE=q_pe.shape[-1], PAGE_SIZE=meta.page_size,
        BLOCK_H=block_h, BLOCK_N=cfg.block_n, DV_SPLIT=cfg.dv_split, PREFETCH=cfg.prefetch,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    if splits > 1:
        merge_splits(part, lse, meta.kv_len, out, splits, cfg.min_split_tokens, cfg.block_n)
    return out


def decode_flops(kv_tokens: int, num_heads: int, rank: int, rope: int) -> int:
    """Multiply-adds x 2 of one decode call: QK^T over R + P and PV over R, per head and
    cached token (what a kernel must do, padding heads not counted)."""
    return 2 * kv_tokens * num_heads * (2 * rank + rope)
