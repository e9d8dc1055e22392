"""Routed experts through DeepGEMM's grouped FP8 GEMMs, in DeepEP's two layouts.

Measured against the fused Triton MoE and the masked Triton MoE by ``dsv3serve bench
kernels --only deepgemm``; not yet wired into the MoE backends (they run Triton). The
``deep_gemm`` module is passed in (``dsv3serve.kernels.deepgemm.deepgemm_module()`` on a GPU,
a fake in the CPU tests). Both GEMMs of an expert take e4m3 rows with one float32 scale per
(row, 128 channels) and the checkpoint's e4m3 weights with 128x128 block scales (the SM90
recipe); the intermediate is SiLU(gate) * up in bf16, quantised per 128 channels like the
fused MoE's ``act_quant`` path.

* Contiguous (normal mode / one rank's prefill), ``m_grouped_fp8_gemm_nt_contiguous``: the
  batch's assignments sorted by expert into blocks of :data:`M_ALIGN` rows
  (:func:`~dsv3serve.moe.align.moe_align_block_size`, DeepGEMM's M alignment on SM90),
  their rows gathered into ``[P, H]``, ``P`` = blocks * 128, with ``m_indices`` [P] int32
  the expert of each row's block (-1 for blocks past the used ones: skipped by DeepGEMM;
  padding rows inside a block are zero rows of that expert). Each token's top-k output rows
  are then weighted and summed. No host sync: sizes follow from T, top-k, E.
* Masked (low-latency mode), ``m_grouped_fp8_gemm_nt_masked``: ``[E, M, H]`` rows with
  ``counts`` [E] int32; rows at or past ``counts[e]`` are padding (never read for valid
  rows' results; their outputs are unspecified). ``expected_m`` is DeepGEMM's tile hint, the
  typical count.
"""

from __future__ import annotations

from types import ModuleType

import torch
import torch.nn.functional as F

from dsv3serve.kernels.fp8_quant import HAS_TRITON, quant_per_token_group_fp8
from dsv3serve.kernels.fp8_ref import FP8_DTYPE
from dsv3serve.moe.align import ExpertBlocks, moe_align_block_size, moe_align_block_size_ref
from dsv3serve.moe.experts import ExpertStack
from dsv3serve.moe.triton_moe import moe_combine

M_ALIGN = 128  # deep_gemm.get_mk_alignment_for_contiguous_layout() on SM90 (v2.1.1)


def _check_stack(stack: ExpertStack, hidden: int) -> tuple[torch.Tensor, torch.Tensor]:
    s13, s2 = stack.w13_scale_inv, stack.w2_scale_inv
    if s13 is None or s2 is None or stack.w13.dtype != FP8_DTYPE:
        raise ValueError("DeepGEMM's grouped GEMMs need e4m3 expert weights with block scales")
    if stack.w13.shape[2] != hidden or stack.w2.shape[1] != hidden:
        raise ValueError(
            f"expected w13 [E, 2I, {hidden}] and w2 [E, {hidden}, I], got "
            f"{tuple(stack.w13.shape)} and {tuple(stack.w2.shape)}"
        )
    return s13, s2


def _quant(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 rows and float32 [rows, cols/128] scales of a [..., cols] tensor (leading dims
    kept)."""
    q, s = quant_per_token_group_fp8(x.reshape(-1, x.shape[-1]))
    return q.view(x.shape), s.view(*x.shape[:-1], s.shape[-1])


def _act(gate_up: torch.Tensor) -> torch.Tensor:
    inter = gate_up.shape[-1] // 2
    return F.silu(gate_up[..., :inter]) * gate_up[..., inter:]


def _blocks(topk_ids: torch.Tensor, num_experts: int) -> ExpertBlocks:
    if HAS_TRITON and topk_ids.is_cuda:
        return moe_align_block_size(topk_ids, num_experts, M_ALIGN)
    return moe_align_block_size_ref(topk_ids, num_experts, M_ALIGN)


def _gather_rows(
    xq: torch.Tensor, xs: torch.Tensor, src: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows ``src`` of (xq, xs), where ``src == len(xq)`` selects a zero row (scale 1)."""
    zq = torch.zeros((1, xq.shape[1]), dtype=torch.uint8, device=xq.device)
    rows = torch.cat([xq.view(torch.uint8), zq])[src].view(FP8_DTYPE)
    scales = torch.cat([xs, torch.ones((1, xs.shape[1]), dtype=xs.dtype, device=xs.device)])
    return rows, scales[src]


def _combine(y: torch.Tensor, topk_weights: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """out[t] = sum_j topk_weights[t, j] * y[t * k + j]."""
    t, k = topk_weights.shape
    if HAS_TRITON and y.is_cuda:
        out = torch.empty((t, y.shape[1]), dtype=dtype, device=y.device)
        return moe_combine(y, topk_weights.contiguous(), out)
    return (y.float().view(t, k, -1) * topk_weights[..., None]).sum(1).to(dtype)


def deepgemm_moe_contiguous(
    module: ModuleType,
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    stack: ExpertStack,
) -> torch.Tensor:
    """Routed experts for ``x`` [T, H] (bf16) with ``topk_weights`` [T, k] float32 and
    ``topk_ids`` [T, k] (negative: another rank's expert, skipped) -> [T, H] in x's dtype."""
    s13, s2 = _check_stack(stack, x.shape[1])
    t, k = topk_ids.shape
    e = stack.w13.shape[0]
    blocks = _blocks(topk_ids, e)
    rows = torch.arange(blocks.sorted_ids.numel(), device=x.device)
    ids = blocks.sorted_ids.long()
    valid = (rows < blocks.num_padded.long()) & (ids < t * k)
    xq, xs = quant_per_token_group_fp8(x)
    aq, as_ = _gather_rows(xq, xs, torch.where(valid, ids // k, t))
    m_indices = blocks.expert_ids.repeat_interleave(M_ALIGN)
    gate_up = torch.empty((rows.numel(), stack.w13.shape[1]), dtype=torch.bfloat16, device=x.device)
    module.m_grouped_fp8_gemm_nt_contiguous((aq, as_), (stack.w13, s13), gate_up, m_indices)
    hq, hs = _quant(_act(gate_up))
    down = torch.empty((rows.numel(), x.shape[1]), dtype=torch.bfloat16, device=x.device)
    module.m_grouped_fp8_gemm_nt_contiguous((hq, hs), (stack.w2, s2), down, m_indices)
    # row of each assignment (t * k + j) in ``down``; skipped ones read the zero row at P
    where = torch.full((t * k + 1,), rows.numel(), dtype=torch.long, device=x.device)
    where.scatter_(0, torch.where(valid, ids, t * k), rows)
    down = torch.cat([down, down.new_zeros((1, down.shape[1]))])
    return _combine(down[where[: t * k]], topk_weights, x.dtype)


def deepgemm_moe_masked(
    module: ModuleType,
    x: torch.Tensor,
    counts: torch.Tensor,
    stack: ExpertStack,
    expected_m: int,
    x_scale: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x`` [E, M, H] bf16, or e4m3 with ``x_scale`` [E, M, H/128] float32 (DeepEP's FP8
    dispatch), ``counts`` [E] int32 -> [E, M, H] bf16 (into ``out`` when given); rows at
    or past ``counts[e]`` unspecified."""
    s13, s2 = _check_stack(stack, x.shape[2])
    e, m, h = x.shape
    if counts.shape != (e,) or counts.dtype != torch.int32:
        raise ValueError(f"expected counts [{e}] int32, got {tuple(counts.shape)} {counts.dtype}")
    xq, xs = (x, x_scale) if x_scale is not None else _quant(x)
    gate_up = torch.empty((e, m, stack.w13.shape[1]), dtype=torch.bfloat16, device=x.device)
    module.m_grouped_fp8_gemm_nt_masked((xq, xs), (stack.w13, s13), gate_up, counts, expected_m)
    hq, hs = _quant(_act(gate_up))
    y = out if out is not None else torch.empty((e, m, h), dtype=torch.bfloat16, device=x.device)
    module.m_grouped_fp8_gemm_nt_masked((hq, hs), (stack.w2, s2), y, counts, expected_m)
    return y
