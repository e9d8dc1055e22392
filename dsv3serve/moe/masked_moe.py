"""Masked grouped MoE for DeepEP's low-latency layout: ``[E, M, H]`` rows with valid counts.

Expert ``e`` runs on ``x[e, :counts[e]]`` (unweighted: low-latency combine applies the
top-k weights); rows at or past ``counts[e]`` are padding holding stale data (NaN in the
tests) and are never read. Two implementations with one contract:

* :func:`masked_moe_ref`: torch, a loop over experts reading the counts on the host.
* :func:`masked_moe_triton`: the fused MoE's GEMM kernels (:mod:`dsv3serve.moe.triton_moe`,
  tuned tiles, e4m3 tensor-core path) over blocks that :func:`masked_blocks` builds from the
  counts on the device: only blocks holding valid rows exist, so padding costs no weight
  reads; no host sync, so it can be captured into a CUDA graph.

Rows arrive as the activation dtype, or (DeepEP's FP8 dispatch) as e4m3 with one float32
scale per (row, 128 channels), ``x_scale`` [E, M, H/128] in any strides. Weights are the
stack of :class:`~dsv3serve.moe.experts.ExpertStack`: e4m3 with 128x128 block scales, or the
activation dtype. Rounding follows :class:`~dsv3serve.moe.ref.TorchRefMoE`: with e4m3 rows
the intermediate is quantised per 128 channels too (the fused path's ``act_quant``); with
16/32-bit rows nothing is quantised (e4m3 weights are upcast in registers).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dsv3serve.kernels.fp8_quant import HAS_TRITON
from dsv3serve.kernels.fp8_ref import (
    FP8_DTYPE,
    dequant_per_token_group,
    dequant_weight_block,
    quant_per_token_group,
)
from dsv3serve.moe.align import ExpertBlocks, max_blocks
from dsv3serve.moe.experts import ExpertStack
from dsv3serve.moe.moe_config import get_config
from dsv3serve.moe.triton_moe import device_name, moe_down, moe_gate_up


@dataclass(frozen=True)
class MaskedRoute:
    """How the group routed the step the masked rows come from: ``tokens`` over all EP
    ranks, ``top_k`` choices each, among ``num_experts`` (all ranks' experts). The masked
    layout has the same rows per expert as the fused MoE on those, so it takes its tile."""

    tokens: int
    top_k: int
    num_experts: int


def _linear_ref(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    wf = w.float() if scale is None else dequant_weight_block(w, scale)
    return (x.float() @ wf.t()).to(x.dtype)


def _requant(h: torch.Tensor) -> torch.Tensor:
    """``h`` through e4m3 per (row, 128 channels) and back, in h's dtype."""
    return dequant_per_token_group(*quant_per_token_group(h)).to(h.dtype)


def masked_moe_ref(
    x: torch.Tensor,
    counts: torch.Tensor,
    stack: ExpertStack,
    x_scale: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """Reference: ``x`` [E, M, H], ``counts`` [E] -> [E, M, H] (x's dtype, or ``out_dtype``
    for e4m3 rows with ``x_scale``), rows at or past ``counts[e]`` zero. Reads the counts on
    the host (one sync)."""
    dtype = x.dtype if x_scale is None else out_dtype
    out = torch.zeros(x.shape, dtype=dtype, device=x.device)
    for e, n in enumerate(counts.tolist()):
        if n == 0:
            continue
        rows = x[e, :n]
        if x_scale is not None:  # float32 rows (exact), gate and up rounded to out_dtype
            rows = dequant_per_token_group(rows, x_scale[e, :n].float())
        s13 = None if stack.w13_scale_inv is None else stack.w13_scale_inv[e]
        s2 = None if stack.w2_scale_inv is None else stack.w2_scale_inv[e]
        gate, up = _linear_ref(rows, stack.w13[e], s13).to(dtype).chunk(2, dim=-1)
        h = F.silu(gate) * up
        out[e, :n] = _linear_ref(h if x_scale is None else _requant(h), stack.w2[e], s2)
    return out


def _check(
    x: torch.Tensor, counts: torch.Tensor, stack: ExpertStack, x_scale: torch.Tensor | None
) -> None:
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
    if (x.dtype == FP8_DTYPE) != (x_scale is not None):
        raise ValueError("expected e4m3 rows with x_scale, or 16/32-bit rows without")
    if x_scale is not None and stack.w13_scale_inv is None:
        raise ValueError("e4m3 rows need e4m3 weights")
    if stack.w13.dtype != FP8_DTYPE and stack.w13.dtype != x.dtype:
        raise ValueError(f"expected e4m3 or {x.dtype} weights, got {stack.w13.dtype}")


def masked_blocks(counts: torch.Tensor, m: int, block_m: int, most_rows: int) -> ExpertBlocks:
    """:class:`ExpertBlocks` over the flattened ``[E * m]`` rows of the masked layout:
    expert ``e``'s valid rows ``e * m + i`` (``i < counts[e]``) in ``ceil(counts[e] /
    block_m)`` blocks, padded with the sentinel ``E * m``; nothing for padding rows. Built
    on the device from ``counts`` (no host sync). ``most_rows``: a bound on ``sum(counts)``
    (sizes the block list; the kernels skip blocks past ``num_padded``)."""
    e = counts.shape[0]
    dev = counts.device
    bound = min(max_blocks(most_rows, e, block_m), e * -(-m // block_m))
    per_expert = (counts.long() + block_m - 1) // block_m
    ends = torch.cumsum(per_expert, 0)
    block = torch.arange(bound, device=dev)
    owner = torch.searchsorted(ends, block, right=True)
    live = owner < e
    owner = owner.clamp(max=e - 1)
    local = (block - (ends - per_expert)[owner])[:, None] * block_m
    local = local + torch.arange(block_m, device=dev)[None, :]
    ok = live[:, None] & (local < counts.long()[owner][:, None])
    sorted_ids = torch.where(ok, owner[:, None] * m + local, e * m).to(torch.int32)
    expert_ids = torch.where(live, owner, -1).to(torch.int32)
    num_padded = (ends[-1:] * block_m).to(torch.int32)
    return ExpertBlocks(sorted_ids.view(-1), expert_ids, num_padded, block_m, e * m)


def masked_moe_triton(
    x: torch.Tensor,
    counts: torch.Tensor,
    stack: ExpertStack,
    out: torch.Tensor | None = None,
    x_scale: torch.Tensor | None = None,
    route: MaskedRoute | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """Triton: ``x`` [E, M, H] (bf16 / fp16 / fp32, or e4m3 with ``x_scale``), ``counts``
    [E] int32 on x's device -> [E, M, H] (x's dtype, or ``out_dtype`` for e4m3 rows), into
    ``out`` when given. Only rows ``< counts[e]`` are written; the rest of ``out`` is left
    as it was. ``route`` picks the tile as the fused MoE would for the same rows per expert
    (default: ``M`` tokens, top-1, over these ``E`` experts)."""
    _check(x, counts, stack, x_scale)
    e, m, h = x.shape
    dtype = x.dtype if x_scale is None else out_dtype
    inter = stack.w2.shape[2]
    fp8 = stack.w13_scale_inv is not None
    dev = device_name(x.device.index or 0) if x.is_cuda else "cpu"
    r = route or MaskedRoute(m, 1, e)
    config = get_config(r.tokens, r.num_experts, inter, h, r.top_k, fp8, dev)
    blocks = masked_blocks(counts, m, config.block_m, e * m)
    flat = x.view(e * m, h)
    scale = None if x_scale is None else x_scale.contiguous().view(e * m, -1)
    hid, hid_scale = moe_gate_up(
        flat, scale, stack.w13, stack.w13_scale_inv, blocks, 1, config.gate_up, dtype
    )
    y = None if out is None else out.view(e * m, h)
    y = moe_down(hid, hid_scale, stack.w2, stack.w2_scale_inv, blocks, config.down, dtype, y)
    return y.view(e, m, h)


def masked_moe(
    x: torch.Tensor,
    counts: torch.Tensor,
    stack: ExpertStack,
    x_scale: torch.Tensor | None = None,
    route: MaskedRoute | None = None,
) -> torch.Tensor:
    """:func:`masked_moe_triton` on a GPU with Triton, else :func:`masked_moe_ref`; padding
    rows of the result are unspecified (the low-latency combine never reads them)."""
    if x.is_cuda and HAS_TRITON:
        c = counts.to(torch.int32)
        return masked_moe_triton(x, c, stack, x_scale=x_scale, route=route)
    return masked_moe_ref(x, counts, stack, x_scale)
