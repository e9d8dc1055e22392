"""Routed experts stored stacked: gate+up as ``w13`` [S, 2I, H], down as ``w2`` [S, H, I].

``S = E + shared_slots``: with shared-expert fusion the stack has one more slot, index E, which
holds the shared expert (its own linears become views of that slot, see
:mod:`dsv3serve.moe.shared`); the checkpoint fills slots 0..E-1 through the expert names.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from dsv3serve.kernels.fp8_ref import BLOCK, FP8_DTYPE, FP8_MAX
from dsv3serve.layers.load_target import LoadTarget


class ExpertStack(NamedTuple):
    """Stacked weights of the experts one fused call runs (e4m3 with scales, or 16/32-bit)."""

    w13: torch.Tensor  # [S, 2I, H]
    w2: torch.Tensor  # [S, H, I]
    w13_scale_inv: torch.Tensor | None  # [S, 2I/128, H/128] float32
    w2_scale_inv: torch.Tensor | None  # [S, H/128, I/128] float32


def _param(shape: tuple[int, ...], dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)


def _blocks(n: int) -> int:
    return -(-n // BLOCK)


class FusedExperts(nn.Module):
    """Weights of the routed experts one rank holds for one MoE layer, loadable from
    per-expert tensors.

    ``num_experts`` counts the experts in the stack (E, or E / ep_size under expert
    parallelism): global experts ``first_expert .. first_expert + num_experts - 1`` in slots
    ``0 .. num_experts - 1``. ``inter`` is the intermediate size held (``I / moe_tp`` when each
    expert is split over ranks). ``shared_slots`` (0 or 1) adds the shared expert's slot at
    index ``num_experts``. ``checkpoint_experts`` (None: ``num_experts``): how many leading
    slots the checkpoint fills; the rest are EPLB's redundant slots, filled by moving weights
    between ranks (:mod:`dsv3serve.eplb.rebalance`).
    """

    def __init__(
        self,
        num_experts: int,
        hidden: int,
        inter: int,
        fp8: bool,
        dtype: torch.dtype,
        shared_slots: int = 0,
        first_expert: int = 0,
        checkpoint_experts: int | None = None,
    ):
        super().__init__()
        self.num_experts, self.hidden, self.inter = num_experts, hidden, inter
        self.shared_slots, self.first_expert = shared_slots, first_expert
        self.checkpoint_experts = num_experts if checkpoint_experts is None else checkpoint_experts
        slots = num_experts + shared_slots
        wdtype = FP8_DTYPE if fp8 else dtype
        self.w13 = _param((slots, 2 * inter, hidden), wdtype)
        self.w2 = _param((slots, hidden, inter), wdtype)
        self.w13_scale_inv: nn.Parameter | None = None
        self.w2_scale_inv: nn.Parameter | None = None
        if fp8:
            if inter % BLOCK:
                raise ValueError(
                    f"moe_intermediate_size must be a multiple of {BLOCK}, got {inter}"
                )
            self.w13_scale_inv = _param((slots, _blocks(2 * inter), _blocks(hidden)), torch.float32)
            self.w2_scale_inv = _param((slots, _blocks(hidden), _blocks(inter)), torch.float32)

    @property
    def is_fp8(self) -> bool:
        return self.w13_scale_inv is not None

    def stack(self, with_shared: bool = False) -> ExpertStack:
        """The routed slots ``[:E]``, or ``[:E + 1]`` with the shared expert (contiguous views)."""
        n = self.num_experts + (1 if with_shared else 0)
        if n > self.num_experts + self.shared_slots:
            raise ValueError(f"expected a shared-expert slot, found {self.shared_slots} slots")
        s13, s2 = self.w13_scale_inv, self.w2_scale_inv
        return ExpertStack(
            self.w13[:n],
            self.w2[:n],
            None if s13 is None else s13[:n],
            None if s2 is None else s2[:n],
        )

    @property
    def expert_ids(self) -> range:
        """The global ids of the routed experts the checkpoint fills, in slot order."""
        return range(self.first_expert, self.first_expert + self.checkpoint_experts)

    def slot_tensors(self) -> list[torch.Tensor]:
        """The stacked tensors (weights, then scales), each [slots, ...]."""
        ts = [self.w13, self.w2, self.w13_scale_inv, self.w2_scale_inv]
        return [t.data for t in ts if t is not None]

    def checkpoint_targets(self, prefix: str) -> dict[str, LoadTarget]:
        """Map ``{prefix}.{g}.{gate,up,down}_proj.weight[_scale_inv]`` of each held global
        expert ``g`` to slot ``g - first_expert`` of the stacks (each rank's slice of a split
        expert: ``inter`` gate/up rows and down columns)."""
        targets: dict[str, LoadTarget] = {}
        i, bi = self.inter, _blocks(self.inter)
        for e, g in enumerate(self.expert_ids):
            base = f"{prefix}.{g}"
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
    num_experts: int,
    hidden: int,
    inter: int,
    fp8: bool,
    dtype: torch.dtype,
    device: str,
    shared_slots: int = 0,
) -> FusedExperts:
    """Random experts (tests, benchmarks) whose real weights have a std of about 0.02.

    e4m3 weights are rounded N(0, 1) samples with block scales drawn from [0.01, 0.03], made
    one expert at a time so the float32 temporaries stay small at DeepSeek-V3 sizes.
    """
    with torch.device(device):
        ex = FusedExperts(num_experts, hidden, inter, fp8, dtype, shared_slots)
        if not fp8:
            ex.w13.data.normal_(0.0, 0.02)
            ex.w2.data.normal_(0.0, 0.02)
            return ex
        for w in (ex.w13, ex.w2):
            for i in range(w.shape[0]):
                w.data[i] = torch.randn(w.shape[1:]).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
        for s in (ex.w13_scale_inv, ex.w2_scale_inv):
            assert s is not None
            s.data.uniform_(0.01, 0.03)
    return ex
