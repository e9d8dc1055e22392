"""Routed experts stored stacked: gate+up as ``w13`` [E, 2I, H], down as ``w2`` [E, H, I]."""

from __future__ import annotations

import torch
from torch import nn

from dsv3serve.kernels.fp8_ref import BLOCK, FP8_DTYPE, FP8_MAX
from dsv3serve.model.load_target import LoadTarget


def _param(shape: tuple[int, ...], dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)


def _blocks(n: int) -> int:
    return -(-n // BLOCK)


class FusedExperts(nn.Module):
    """Weights of all routed experts of one MoE layer, loadable from per-expert tensors."""

    def __init__(self, num_experts: int, hidden: int, inter: int, fp8: bool, dtype: torch.dtype):
        super().__init__()
        self.num_experts, self.hidden, self.inter = num_experts, hidden, inter
        wdtype = FP8_DTYPE if fp8 else dtype
        self.w13 = _param((num_experts, 2 * inter, hidden), wdtype)
        self.w2 = _param((num_experts, hidden, inter), wdtype)
        self.w13_scale_inv: nn.Parameter | None = None
        self.w2_scale_inv: nn.Parameter | None = None
        if fp8:
            if inter % BLOCK:
                raise ValueError(
                    f"moe_intermediate_size must be a multiple of {BLOCK}, got {inter}"
                )
            self.w13_scale_inv = _param(
                (num_experts, _blocks(2 * inter), _blocks(hidden)), torch.float32
            )
            self.w2_scale_inv = _param(
                (num_experts, _blocks(hidden), _blocks(inter)), torch.float32
            )

    @property
    def is_fp8(self) -> bool:
        return self.w13_scale_inv is not None

    def checkpoint_targets(self, prefix: str) -> dict[str, LoadTarget]:
        """Map ``{prefix}.{e}.{gate,up,down}_proj.weight[_scale_inv]`` to slices of the stacks."""
        targets: dict[str, LoadTarget] = {}
        i, bi = self.inter, _blocks(self.inter)
        for e in range(self.num_experts):
            base = f"{prefix}.{e}"
            targets[f"{base}.gate_proj.weight"] = LoadTarget(self.w13, (e, slice(0, i)))
            targets[f"{base}.up_proj.weight"] = LoadTarget(self.w13, (e, slice(i, 2 * i)))
            targets[f"{base}.down_proj.weight"] = LoadTarget(self.w2, (e,))
            if self.w13_scale_inv is not None and self.w2_scale_inv is not None:
                s13 = self.w13_scale_inv
                targets[f"{base}.gate_proj.weight_scale_inv"] = LoadTarget(s13, (e, slice(0, bi)))
                targets[f"{base}.up_proj.weight_scale_inv"] = LoadTarget(
                    s13, (e, slice(bi, 2 * bi))
                )
                targets[f"{base}.down_proj.weight_scale_inv"] = LoadTarget(self.w2_scale_inv, (e,))
        return targets


def random_experts(
    num_experts: int, hidden: int, inter: int, fp8: bool, dtype: torch.dtype, device: str
) -> FusedExperts:
    """Random experts (tests, benchmarks) whose real weights have a std of about 0.02.

    e4m3 weights are rounded N(0, 1) samples with block scales drawn from [0.01, 0.03], made
    one expert at a time so the float32 temporaries stay small at DeepSeek-V3 sizes.
    """
    with torch.device(device):
        ex = FusedExperts(num_experts, hidden, inter, fp8, dtype)
        if not fp8:
            ex.w13.data.normal_(0.0, 0.02)
            ex.w2.data.normal_(0.0, 0.02)
            return ex
        for w in (ex.w13, ex.w2):
            for i in range(num_experts):
                w.data[i] = torch.randn(w.shape[1:]).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
        for s in (ex.w13_scale_inv, ex.w2_scale_inv):
            assert s is not None
            s.data.uniform_(0.01, 0.03)
    return ex
