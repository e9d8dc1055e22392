"""Linears built with their LOCAL shape on one rank of a parallel layout.

The slice a rank holds comes from :func:`dsv3serve.parallel.shard.placement_of` (the one
shard rule); this module only applies it to a linear's ``[out, in]`` weight. A
column-parallel linear (split on dim 0) yields this rank's output columns; a row-parallel
one (split on dim 1) a partial sum that its owner all-reduces.
"""

from __future__ import annotations

import torch

from dsv3serve.config import ModelConfig
from dsv3serve.layers.linear import Linear, is_fp8_layer
from dsv3serve.parallel.shard import Placement, RankLayout, check_split, placement_of


def linear_placement(cfg: ModelConfig, prefix: str, layout: RankLayout | None) -> Placement:
    """Where the weight of the linear named ``prefix`` lives on this rank (whole: no layout)."""
    if layout is None:
        return Placement()
    return placement_of(f"{prefix}.weight", layout, cfg.n_routed_experts)


def sharded_linear(
    cfg: ModelConfig,
    prefix: str,
    in_features: int,
    out_features: int,
    dtype: torch.dtype,
    act_quant: bool = True,
    layout: RankLayout | None = None,
) -> Linear:
    """The linear named ``prefix`` (full shape ``[out_features, in_features]``) as this rank
    holds it: ``placement_of``'s local shape, FP8 splits refused off 128 boundaries
    (:class:`~dsv3serve.parallel.config.LayoutError`). ``layout`` None: the whole linear.

    Its precision is the checkpoint's (:func:`~dsv3serve.layers.linear.is_fp8_layer`)."""
    placement = linear_placement(cfg, prefix, layout)
    fp8 = is_fp8_layer(cfg, prefix)
    check_split(f"{prefix}.weight", (out_features, in_features), placement, fp8)
    out_local, in_local = placement.local_shape((out_features, in_features))
    return Linear(in_local, out_local, fp8, dtype, act_quant)


def is_row_parallel(cfg: ModelConfig, prefix: str, layout: RankLayout | None) -> bool:
    """Whether the linear ``prefix`` is split along its input (its output is a partial sum)."""
    split = linear_placement(cfg, prefix, layout).split
    return split is not None and split.dim == 1
