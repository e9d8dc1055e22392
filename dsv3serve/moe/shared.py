"""Shared-expert fusion: the shared expert as slot E of the routed-expert stack.

DeepSeek-V3's shared expert has the routed experts' shape (``n_shared_experts * I == I``), so
it can run as expert index E (the 257th) in the fused MoE: every token gets it as one more
assignment with weight 1, and the gate/up, SiLU*mul, down and weighted-reduce launches cover
it. The router has already multiplied the routed weights by ``routed_scaling_factor``; the
appended weight 1 is not scaled, as in the separate form ``routed + shared(x)``.

``shared_experts_fusion`` (SGLang's ``--disable-shared-experts-fusion`` is our ``off``):

- ``on``: fuse at every token count (any backend; the torch reference loops over it too);
- ``off``: run the shared expert as its own MLP;
- ``auto``: with the Triton backend on CUDA, fuse up to the token count measured faster on
  this GPU and shape (``configs/shared_fusion.json``, written by ``dsv3serve bench kernels
  --only moe --write-shared-fusion``); without a measurement, never.

The shared expert's linears become views into slot E (no second copy of its weights), so the
separate form stays available at token counts where it is faster.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Literal

import torch

from dsv3serve.kernels.fp8_ref import BLOCK
from dsv3serve.moe import moe_backend_class
from dsv3serve.moe.experts import FusedExperts
from dsv3serve.moe.moe_config import shared_fusion_max_tokens

SharedFusion = Literal["auto", "on", "off"]
NEVER = -1


def append_shared_expert(
    topk_weights: torch.Tensor, topk_ids: torch.Tensor, shared_id: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights [T, k+1], ids [T, k+1])``: every token also goes to ``shared_id``, weight 1."""
    t = topk_ids.shape[0]
    ones = torch.ones((t, 1), dtype=topk_weights.dtype, device=topk_weights.device)
    shared = torch.full((t, 1), shared_id, dtype=topk_ids.dtype, device=topk_ids.device)
    return torch.cat([topk_weights, ones], dim=1), torch.cat([topk_ids, shared], dim=1)


def fusable_reason(n_shared_experts: int, shared_fp8: bool, experts_fp8: bool) -> str | None:
    """Why the shared expert cannot be slot E (None when it can)."""
    if n_shared_experts != 1:
        return f"expected n_shared_experts 1 (one expert's width), found {n_shared_experts}"
    if shared_fp8 != experts_fp8:
        return f"expected the same precision, found shared fp8={shared_fp8}, experts {experts_fp8}"
    return None


def packs_shared(mode: SharedFusion, backend: str) -> bool:
    """Whether the layer builds the extra slot: ``on``, or ``auto`` with a backend that
    packs the shared expert (the Triton one)."""
    return mode == "on" or (mode == "auto" and moe_backend_class(backend).packs_shared_expert)


def fusion_max_tokens(
    mode: SharedFusion, backend: str, experts: FusedExperts, device: torch.device
) -> int:
    """The largest token count that runs fused (``NEVER`` = -1 for none)."""
    if mode == "on":
        return sys.maxsize
    if mode == "off" or not packs_shared(mode, backend) or device.type != "cuda":
        return NEVER
    from dsv3serve.moe.triton_moe import device_name

    name = device_name(device.index or 0)
    fp8, e, i, h = experts.is_fp8, experts.num_experts, experts.inter, experts.hidden
    return shared_fusion_max_tokens(e, i, h, name, fp8)


def _slot_parts(experts: FusedExperts, weights: Sequence[torch.Tensor], scales: list) -> list:
    e, i, bi = experts.num_experts, experts.inter, -(-experts.inter // BLOCK)
    pairs = [
        (weights[0], experts.w13.data[e, :i]),
        (weights[1], experts.w13.data[e, i:]),
        (weights[2], experts.w2.data[e]),
    ]
    s13, s2 = experts.w13_scale_inv, experts.w2_scale_inv
    if s13 is not None and s2 is not None:
        pairs += [
            (scales[0], s13.data[e, :bi]),
            (scales[1], s13.data[e, bi : 2 * bi]),
            (scales[2], s2.data[e]),
        ]
    return pairs


def tie_shared_expert(
    experts: FusedExperts, gate_up_down: list[torch.nn.Parameter], scales: list
) -> None:
    """Make the shared expert's parameters views of slot E, copying their values there first
    unless they already are those views (after loading, or a device move that broke them).

    ``gate_up_down``: the gate, up and down weights [I, H], [I, H], [H, I]; ``scales``: their
    ``weight_scale_inv`` (empty for 16-bit weights).
    """
    if experts.shared_slots != 1:
        raise ValueError(f"expected a stack with a shared slot, found {experts.shared_slots}")
    for param, slot in _slot_parts(experts, gate_up_down, scales):
        if tuple(param.shape) != tuple(slot.shape) or param.dtype != slot.dtype:
            raise ValueError(
                f"expected shared-expert tensor {list(slot.shape)} {slot.dtype}, "
                f"found {list(param.shape)} {param.dtype}"
            )
        if param.data.data_ptr() != slot.data_ptr():
            slot.copy_(param.data)
        param.data = slot
