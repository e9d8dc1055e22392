"""Give the draft (NextN) layer its own weight precision, independent of the target's.

``speculative_draft_model_quantization``: ``"fp8"`` quantises its projections and experts
to e4m3 with 128x128 block scales (the layers an FP8 DeepSeek checkpoint quantises:
not ``eh_proj`` nor the router gate); ``"unquant"`` dequantises them to the compute dtype.
Norms, the router and the shared embedding / head are untouched.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import nn

from dsv3serve.kernels.fp8_ref import dequant_weight_block, quant_weight_block
from dsv3serve.layers.linear import Linear
from dsv3serve.model.deepseek_v3 import MLAttention, MoE, NextNLayer
from dsv3serve.moe.experts import FusedExperts

DraftQuant = Literal["fp8", "unquant"]
_KEEP_UNQUANTISED = ("eh_proj",)


def requantize_draft(layer: NextNLayer, mode: DraftQuant, dtype: torch.dtype) -> None:
    """Convert ``layer``'s linears and experts in place to ``mode`` (see module docstring)."""
    for name, module in layer.named_modules():
        if isinstance(module, Linear) and not name.endswith(_KEEP_UNQUANTISED):
            _convert(module, "weight", "weight_scale_inv", mode, dtype)
        elif isinstance(module, FusedExperts):
            _convert(module, "w13", "w13_scale_inv", mode, dtype)
            _convert(module, "w2", "w2_scale_inv", mode, dtype)
    for module in layer.modules():
        if isinstance(module, MLAttention):
            module.post_load()  # the absorbed W_UK / W_UV follow the new kv_b_proj
        elif isinstance(module, MoE) and module.experts.shared_slots:
            module.tie_shared()  # converted apart: the shared expert is slot E's views again
    layer.block.plan_fusion()  # the fused paths follow the new weight precision


def _convert(
    module: nn.Module, weight: str, scale: str, mode: DraftQuant, dtype: torch.dtype
) -> None:
    w: torch.Tensor = getattr(module, weight)
    s: torch.Tensor | None = getattr(module, scale)
    if (mode == "fp8") == (s is not None):
        return  # already in the requested form
    matrices = w.unsqueeze(0) if w.dim() == 2 else w  # experts are stacked [E, N, K]
    if mode == "unquant":
        assert s is not None
        scales = s.unsqueeze(0) if s.dim() == 2 else s
        pairs = zip(matrices, scales, strict=True)
        deq = torch.stack([dequant_weight_block(m, sc) for m, sc in pairs])
        setattr(module, weight, _param(deq.view(w.shape).to(dtype)))
        setattr(module, scale, None)
        return
    quantized = [quant_weight_block(m) for m in matrices]
    q = torch.stack([p[0] for p in quantized]).view(w.shape)
    sc = torch.stack([p[1] for p in quantized])
    setattr(module, weight, _param(q))
    setattr(module, scale, _param(sc.view(sc.shape[1:]) if w.dim() == 2 else sc))


def _param(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t.contiguous(), requires_grad=False)
