"""Fused MoE in Triton: routed experts over expert-sorted token blocks, FP8 block-scaled or bf16.

One forward, for x [T, H] routed to ``top_k`` experts per token (``M = T * top_k``
assignments):

1. :func:`moe_align_block_size` sorts the assignments into per-expert blocks of ``block_m``;
2. with FP8 weights and activation quantisation, x is quantised per (token, 128 channels)
   (:func:`quant_per_token_group_fp8`);
3. the gate/up kernel computes ``h = silu(x W_gate^T) * (x W_up^T)`` per assignment, from the
   stacked ``w13`` [E, 2I, H], and quantises h per 128 channels in its epilogue (e4m3 [M, I]
   + float32 scales [M, I/128]) or stores it in x's dtype;
4. the down kernel computes ``y = h W_down^T`` [M, H] in x's dtype from ``w2`` [E, H, I];
5. the combine kernel sums ``topk_weights[t, j] * y[t * top_k + j]`` in float32 into [T, H].

The routing weights are applied in step 5, as given: the caller (the router) has already
multiplied them by ``routed_scaling_factor``. Rounding follows :class:`TorchRefMoE`: the gate
and up outputs, silu and the product are rounded to x's dtype, each expert's output too, and
the weighted sum is float32. The shared expert is fused by the caller appending it as expert E
with weight 1 to every token (:mod:`dsv3serve.moe.shared`): the kernels then see E + 1
experts and ``top_k + 1`` assignments per token, and its table is E + 1's. Under expert
parallelism a choice of an expert this rank does not hold has id -1 and weight 0: it joins no
block, no GEMM computes it, and the combine skips it.
"""

from __future__ import annotations

import functools

import torch

from dsv3serve.kernels.fp8_quant import HAS_TRITON, SCALE_EPS, quant_per_token_group_fp8
from dsv3serve.kernels.fp8_ref import BLOCK, FP8_DTYPE, FP8_MAX
from dsv3serve.moe.align import ExpertBlocks, moe_align_block_size
from dsv3serve.moe.base import MoEBackend
from dsv3serve.moe.experts import FusedExperts
from dsv3serve.moe.gate_triton import grouped_topk_fused
from dsv3serve.moe.moe_config import GemmTile, MoEConfig, get_config
from dsv3serve.moe.ref import TorchRefMoE

if HAS_TRITON:
    import triton

    from dsv3serve.moe.triton_kernels import combine_kernel, down_kernel, gate_up_kernel

_ROUND_CODE = {torch.bfloat16: 1, torch.float16: 2, torch.float32: 0}
COMBINE_BLOCK = 512


@functools.cache
def device_name(index: int) -> str:
    """``torch.cuda.get_device_name`` of one device, looked up once."""
    return torch.cuda.get_device_name(index)


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


def _stages(tile: GemmTile, a_scaled: bool, b_scaled: bool) -> int:
    # 16-bit activations with e4m3 weights also stage the upcast weights: keep the smem small
    return min(tile.num_stages, 2) if b_scaled and not a_scaled else tile.num_stages


def _check_tile(tile: GemmTile, scaled: bool) -> None:
    if scaled:  # one weight scale (and activation scale) per K step
        assert BLOCK % tile.block_k == 0, f"expected block_k dividing {BLOCK}, got {tile.block_k}"


def moe_gate_up(
    a: torch.Tensor,
    a_scale: torch.Tensor | None,
    w13: torch.Tensor,
    w13_scale: torch.Tensor | None,
    blocks: ExpertBlocks,
    top_k: int,
    tile: GemmTile,
    act_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Gate/up GEMM with SiLU*mul over the blocks: ``(h [M, I], h_scale [M, I/128] | None)``.

    a [T, H]: e4m3 with ``a_scale`` [T, H/128] float32, or ``act_dtype`` with no scale;
    w13 [E, 2I, H] (e4m3 with ``w13_scale`` [E, 2I/128, H/128], or ``act_dtype``). With
    e4m3 activations h is e4m3 with scales (``tile.block_n`` must be 128), else ``act_dtype``.
    """
    e, two_i, hidden = w13.shape
    inter = two_i // 2
    a_scaled, b_scaled = a_scale is not None, w13_scale is not None
    assert not a_scaled or b_scaled, "e4m3 activations need e4m3 weights"
    assert not a_scaled or tile.block_n == BLOCK, f"quantised h needs block_n {BLOCK}"
    _check_tile(tile, b_scaled)
    m = blocks.num_assign
    h = torch.empty((m, inter), dtype=FP8_DTYPE if a_scaled else act_dtype, device=a.device)
    hs = torch.empty((m, inter // BLOCK), dtype=torch.float32, device=a.device) if a_scaled else h
    a_s = a_scale if a_scale is not None else a
    w_s = w13_scale if w13_scale is not None else w13
    grid = (blocks.max_blocks, triton.cdiv(inter, tile.block_n))
    gate_up_kernel[grid](
        a, a_s, w13, w_s, h, hs, blocks.sorted_ids, blocks.expert_ids, blocks.num_padded, m,
        a.stride(0), a_s.stride(0) if a_scaled else 0, a_s.stride(1) if a_scaled else 0,
        w13.stride(0), w13.stride(1), w_s.stride(0) if b_scaled else 0,
        w_s.stride(1) if b_scaled else 0, w_s.stride(2) if b_scaled else 0,
        h.stride(0), hs.stride(0) if a_scaled else 0, hs.stride(1) if a_scaled else 0,
        K=hidden, INTER=inter, TOP_K=top_k, BLOCK_M=blocks.block_m, BLOCK_N=tile.block_n,
        BLOCK_K=tile.block_k, SCALE_BLOCK=BLOCK, A_SCALED=a_scaled, B_SCALED=b_scaled,
        QUANT_OUT=a_scaled, EVEN_K=hidden % tile.block_k == 0, SWAP_AB=tile.swap_ab,
        ROUND=_ROUND_CODE[act_dtype], PRECISION=_precision(act_dtype), EPS=SCALE_EPS,
        QMAX=FP8_MAX, num_warps=tile.num_warps, num_stages=_stages(tile, a_scaled, b_scaled),
    )  # fmt: skip
    return h, (hs if a_scaled else None)


def moe_down(
    h: torch.Tensor,
    h_scale: torch.Tensor | None,
    w2: torch.Tensor,
    w2_scale: torch.Tensor | None,
    blocks: ExpertBlocks,
    tile: GemmTile,
    out_dtype: torch.dtype,
    y: torch.Tensor | None = None,
) -> torch.Tensor:
    """Down GEMM over the blocks: y [M, H] in ``out_dtype``, one row per assignment (into
    ``y`` when given: rows of no block are left as they were).

    h [M, I] (e4m3 with ``h_scale`` [M, I/128], or 16/32-bit); w2 [E, H, I] (e4m3 with
    ``w2_scale`` [E, H/128, I/128], or 16/32-bit).
    """
    e, hidden, inter = w2.shape
    a_scaled, b_scaled = h_scale is not None, w2_scale is not None
    assert not a_scaled or b_scaled, "e4m3 activations need e4m3 weights"
    _check_tile(tile, b_scaled)
    m = blocks.num_assign
    if y is None:
        y = torch.empty((m, hidden), dtype=out_dtype, device=h.device)
    assert y.shape == (m, hidden) and y.stride(1) == 1, f"expected y [{m}, {hidden}]"
    h_s = h_scale if h_scale is not None else h
    w_s = w2_scale if w2_scale is not None else w2
    grid = (blocks.max_blocks, triton.cdiv(hidden, tile.block_n))
    down_kernel[grid](
        h, h_s, w2, w_s, y, blocks.sorted_ids, blocks.expert_ids, blocks.num_padded, m,
        h.stride(0), h_s.stride(0) if a_scaled else 0, h_s.stride(1) if a_scaled else 0,
        w2.stride(0), w2.stride(1), w_s.stride(0) if b_scaled else 0,
        w_s.stride(1) if b_scaled else 0, w_s.stride(2) if b_scaled else 0, y.stride(0),
        K=inter, N=hidden, BLOCK_M=blocks.block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k,
        SCALE_BLOCK=BLOCK, A_SCALED=a_scaled, B_SCALED=b_scaled,
        EVEN_K=inter % tile.block_k == 0, SWAP_AB=tile.swap_ab,
        PRECISION=_precision(out_dtype),
        num_warps=tile.num_warps, num_stages=_stages(tile, a_scaled, b_scaled),
    )  # fmt: skip
    return y


def moe_combine(y: torch.Tensor, topk_weights: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out[t] = sum_j topk_weights[t, j] * y[t * k + j] (float32 sum); out [T, H] is returned."""
    t, top_k = topk_weights.shape
    hidden = y.shape[1]
    grid = (t, triton.cdiv(hidden, COMBINE_BLOCK))
    combine_kernel[grid](
        y, topk_weights, out, y.stride(0), topk_weights.stride(0), out.stride(0),
        N=hidden, TOP_K=top_k, BLOCK=COMBINE_BLOCK, num_warps=4,
    )  # fmt: skip
    return out


def _check_inputs(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
) -> None:
    t, hidden = x.shape
    e, two_i, _ = w13.shape
    assert x.dtype in _ROUND_CODE, f"expected bf16, fp16 or fp32 activations, got {x.dtype}"
    assert x.stride(1) == 1, "expected x with unit stride along hidden"
    assert w13.shape == (e, two_i, hidden) and w13.is_contiguous(), (
        f"expected contiguous w13 [E, 2I, {hidden}], got {list(w13.shape)}"
    )
    assert w2.shape == (e, hidden, two_i // 2) and w2.is_contiguous(), (
        f"expected contiguous w2 [{e}, {hidden}, {two_i // 2}], got {list(w2.shape)}"
    )
    assert topk_ids.shape == topk_weights.shape and topk_ids.shape[0] == t, (
        f"expected topk ids and weights [{t}, k], got {list(topk_ids.shape)} and "
        f"{list(topk_weights.shape)}"
    )
    assert topk_weights.dtype == torch.float32, (
        f"expected float32 weights, got {topk_weights.dtype}"
    )


@torch.compiler.disable  # opaque to torch.compile: Inductor fails to re-emit our Triton kernels
def fused_moe(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    act_quant: bool = True,
    config: MoEConfig | None = None,
) -> torch.Tensor:
    """Routed experts for x [T, H] (steps in the module docstring); returns [T, H] in x.dtype.

    topk_weights [T, k] float32 (already scaled), topk_ids [T, k] int32/int64 (-1 with weight
    0: skipped, see the module docstring). Runs the kernels
    whatever the device (the interpreter runs them on CPU tensors); ``config`` defaults to
    :func:`get_config` for this shape and device.
    """
    _check_inputs(x, topk_weights, topk_ids, w13, w2)
    t, hidden = x.shape
    e, two_i, _ = w13.shape
    out = torch.empty_like(x)
    if t == 0:
        return out
    fp8 = w13_scale is not None
    if config is None:
        dev = device_name(x.device.index or 0) if x.is_cuda else "cpu"
        config = get_config(t, e, two_i // 2, hidden, topk_ids.shape[1], fp8, dev)
    blocks = moe_align_block_size(topk_ids, e, config.block_m)
    a, a_scale = quant_per_token_group_fp8(x) if fp8 and act_quant else (x, None)
    h, h_scale = moe_gate_up(
        a, a_scale, w13, w13_scale, blocks, topk_ids.shape[1], config.gate_up, x.dtype
    )
    y = moe_down(h, h_scale, w2, w2_scale, blocks, config.down, x.dtype)
    return moe_combine(y, topk_weights.contiguous(), out)


class TritonMoE(MoEBackend):
    """The fused Triton MoE on CUDA tensors; the torch reference elsewhere (CPU, no Triton).

    Routes with the fused gate kernel (on CUDA) and packs the shared expert under ``auto``.
    """

    route = staticmethod(grouped_topk_fused)
    routes_in_kernel = True
    packs_shared_expert = True

    def __init__(self, act_quant: bool = True) -> None:
        self.act_quant = act_quant
        self._ref = TorchRefMoE(act_quant)

    def forward(
        self,
        x: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        experts: FusedExperts,
        with_shared: bool = False,
    ) -> torch.Tensor:
        if not (HAS_TRITON and x.is_cuda):
            return self._ref.forward(x, topk_weights, topk_ids, experts, with_shared)
        stack = experts.stack(with_shared)
        return fused_moe(x, topk_weights, topk_ids, *stack, act_quant=self.act_quant)
