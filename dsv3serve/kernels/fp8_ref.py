"""Torch reference for DeepSeek's FP8 block quantisation (runs on CPU and GPU).

Weights: ``float8_e4m3fn`` [N, K] with ``weight_scale_inv`` float32
[ceil(N/128), ceil(K/128)]; the real value of block (i, j) is ``w * scale_inv[i, j]``.
Activations: quantised at run time per token per 128 channels, with one float32 scale
per group equal to ``amax / 448``.
"""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
BLOCK = 128


def _pad_to(x: torch.Tensor, dim: int, multiple: int) -> torch.Tensor:
    pad = (-x.shape[dim]) % multiple
    if pad == 0:
        return x
    widths = [0, 0] * (x.dim() - 1 - dim) + [0, pad]
    return torch.nn.functional.pad(x, widths)


def quant_per_token_group(x: torch.Tensor, group: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise ``x`` [M, K] to e4m3 with one scale per (token, 128 channels).

    Returns ``(x_fp8 [M, K], scale [M, ceil(K/group)] float32)``.
    """
    m, k = x.shape
    xp = _pad_to(x.float(), 1, group).view(m, -1, group)
    scale = xp.abs().amax(dim=-1).clamp(min=1e-10) / FP8_MAX
    q = (xp / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.view(m, -1)[:, :k].contiguous(), scale


def dequant_per_token_group(
    q: torch.Tensor, scale: torch.Tensor, group: int = BLOCK
) -> torch.Tensor:
    """Inverse of :func:`quant_per_token_group`, in float32."""
    m, k = q.shape
    qp = _pad_to(q.float(), 1, group).view(m, -1, group)
    return (qp * scale[..., None]).view(m, -1)[:, :k]


def quant_weight_block(w: torch.Tensor, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise a weight [N, K] per 128x128 block: ``(w_fp8, weight_scale_inv)``."""
    n, k = w.shape
    wp = _pad_to(_pad_to(w.float(), 0, block), 1, block)
    nb, kb = wp.shape[0] // block, wp.shape[1] // block
    blocks = wp.view(nb, block, kb, block)
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-10) / FP8_MAX
    q = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.view(nb * block, kb * block)[:n, :k].contiguous(), scale


def dequant_weight_block(
    w: torch.Tensor, scale_inv: torch.Tensor, block: int = BLOCK
) -> torch.Tensor:
    """Dequantise an e4m3 weight [N, K] with block scales [ceil(N/128), ceil(K/128)] (float32)."""
    n, k = w.shape
    s = scale_inv.float().repeat_interleave(block, 0)[:n].repeat_interleave(block, 1)[:, :k]
    return w.float() * s


def fp8_block_linear_ref(
    x: torch.Tensor, w: torch.Tensor, scale_inv: torch.Tensor, act_quant: bool = True
) -> torch.Tensor:
    """``x @ dequant(w).T`` with x [.., K]; activations quantised per 128-group when asked.

    Computes in float32 and returns ``x.dtype``.
    """
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    xf = dequant_per_token_group(*quant_per_token_group(x2)) if act_quant else x2.float()
    y = xf @ dequant_weight_block(w, scale_inv).t()
    return y.to(x.dtype).view(*shape[:-1], w.shape[0])
