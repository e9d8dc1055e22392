"""Torch reference MoE: a loop over the experts that received tokens."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dsv3serve.kernels.fp8_ref import fp8_block_linear_ref
from dsv3serve.moe.base import MoEBackend
from dsv3serve.moe.experts import FusedExperts


def _expert_linear(
    x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor | None, act_quant: bool
) -> torch.Tensor:
    if scale is None:
        return F.linear(x, w)
    return fp8_block_linear_ref(x, w, scale, act_quant)


class TorchRefMoE(MoEBackend):
    """Reference routed-expert computation (CPU and GPU); fp32 accumulation of the sum."""

    def __init__(self, act_quant: bool = True) -> None:
        self.act_quant = act_quant

    def forward(
        self,
        x: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        experts: FusedExperts,
        with_shared: bool = False,
    ) -> torch.Tensor:
        # the loop runs the experts the ids name, the shared slot E included when present;
        # negative ids (experts on other EP ranks) are skipped
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        hit = [e for e in torch.unique(topk_ids).tolist() if e >= 0]
        for e in hit:
            token_idx, slot = torch.nonzero(topk_ids == e, as_tuple=True)
            out.index_add_(
                0,
                token_idx,
                self._expert(x[token_idx], e, experts).float()
                * topk_weights[token_idx, slot, None],
            )
        return out.to(x.dtype)

    def _expert(self, x: torch.Tensor, e: int, ex: FusedExperts) -> torch.Tensor:
        s13 = None if ex.w13_scale_inv is None else ex.w13_scale_inv[e]
        s2 = None if ex.w2_scale_inv is None else ex.w2_scale_inv[e]
        gate, up = _expert_linear(x, ex.w13[e], s13, self.act_quant).chunk(2, dim=-1)
        return _expert_linear(F.silu(gate) * up, ex.w2[e], s2, self.act_quant)
