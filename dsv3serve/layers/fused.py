"""Pack linears that read the same input into one GEMM (rows concatenated along N)."""

from __future__ import annotations

import torch
from torch import nn

from dsv3serve.kernels.fp8_ref import BLOCK
from dsv3serve.layers.linear import Linear


def can_pack(linears: list[Linear]) -> bool:
    """Whether ``linears`` can share one GEMM: same input width, precision and activation
    quantisation, and (FP8) every part but the last a whole number of 128-row scale blocks."""
    first = linears[0]
    same = all(
        lin.in_features == first.in_features
        and lin.is_fp8 == first.is_fp8
        and lin.act_quant == first.act_quant
        and lin.weight.dtype == first.weight.dtype
        for lin in linears
    )
    aligned = not first.is_fp8 or all(lin.out_features % BLOCK == 0 for lin in linears[:-1])
    return same and aligned


def pack_rows(linears: list[Linear]) -> Linear:
    """One Linear computing ``cat([lin(x) for lin in linears], -1)``.

    The packed weight (and FP8 block scales) own the storage afterwards: each part's
    parameters become views into it, so packing does not double the memory and the parts
    (and their checkpoint names) keep working. Call again after reloading the parts.
    """
    if not can_pack(linears):
        raise ValueError("these linears cannot be packed into one GEMM")
    first = linears[0]
    out = sum(lin.out_features for lin in linears)
    packed = Linear(first.in_features, out, first.is_fp8, first.weight.dtype, first.act_quant)
    packed.weight = nn.Parameter(torch.cat([lin.weight.data for lin in linears]), False)
    if first.is_fp8:
        scales = torch.cat([lin.weight_scale_inv.data for lin in linears])  # type: ignore[union-attr]
        packed.weight_scale_inv = nn.Parameter(scales, False)
    _repoint(linears, packed)
    return packed


def _repoint(linears: list[Linear], packed: Linear) -> None:
    """Make each part's weight (and scales) a view of its rows of ``packed``."""
    row = block = 0
    for lin in linears:
        n = lin.out_features
        lin.weight.data = packed.weight.data[row : row + n]
        if packed.weight_scale_inv is not None and lin.weight_scale_inv is not None:
            nb = lin.weight_scale_inv.shape[0]
            lin.weight_scale_inv.data = packed.weight_scale_inv.data[block : block + nb]
            block += nb
        row += n
