"""Which slice of each checkpoint tensor a rank holds: the one sharding rule.

The model builds its local shapes from :class:`RankLayout`, the loader reads exactly
:func:`placement_of`'s slice of each safetensors tensor, and the planner sums the bytes of
the same slices, so the three cannot disagree. FP8 ``weight_scale_inv`` tensors (one value
per 128x128 block) are split with their weights: a split that does not fall on a 128
boundary of the weight is refused.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from dsv3serve.config import ModelConfig
from dsv3serve.parallel.config import LayoutError, ParallelConfig

BLOCK = 128  # FP8 block size of DeepSeek's weight_scale_inv
_EXPERT = re.compile(r"\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.")
_ATTN_COL = re.compile(r"\.self_attn\.(q_b_proj|q_proj|kv_b_proj)\.")
_ATTN_ROW = re.compile(r"\.self_attn\.o_proj\.")
_SHARED = re.compile(r"\.mlp\.shared_experts\.(gate_proj|up_proj|down_proj)\.")
_DENSE = re.compile(r"\.mlp\.(gate_proj|up_proj|down_proj)\.")


@dataclass(frozen=True)
class RankLayout:
    """One rank's roles in its group's :class:`ParallelConfig`."""

    parallel: ParallelConfig
    rank: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.parallel.world_size:
            raise LayoutError(f"rank {self.rank} outside a group of {self.parallel.world_size}")

    @property
    def world_size(self) -> int:
        return self.parallel.world_size

    @property
    def dp_rank(self) -> int:
        """The DP-attention rank (0 without DP attention)."""
        return self.rank // self.parallel.attn_tp_size if self.parallel.enable_dp_attention else 0

    def tp_rank(self, size: int) -> int:
        """This rank's index in a split over ``size`` ranks (1: replicated, else the group)."""
        return 0 if size == 1 else self.rank % size

    def expert_range(self, num_experts: int) -> range:
        """The routed experts this rank holds (all of them without EP)."""
        ep = self.parallel.ep_size
        per_rank = num_experts // ep
        first = self.tp_rank(ep) * per_rank
        return range(first, first + per_rank)


@dataclass(frozen=True)
class Split:
    """The ``rank``-th of ``parts`` equal slices along ``dim``. ``padded``: the size need not
    divide; each rank holds ``ceil(size / parts)`` rows, the last ones past the end zero
    (vLLM's and SGLang's padded vocabulary split)."""

    dim: int
    rank: int
    parts: int
    padded: bool = False

    def _size(self, full: int) -> int:
        return -(-full // self.parts) if self.padded else full // self.parts

    def local_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        out = list(shape)
        out[self.dim] = self._size(shape[self.dim])
        return tuple(out)

    def index(self, shape: tuple[int, ...]) -> tuple[slice, ...]:
        """The slice of a tensor of full ``shape`` this rank reads (shorter than its local
        shape on the last ranks of a padded split: the reader pads it with zeros)."""
        size, full = self._size(shape[self.dim]), shape[self.dim]
        idx = [slice(None)] * len(shape)
        idx[self.dim] = slice(min(self.rank * size, full), min((self.rank + 1) * size, full))
        return tuple(idx)


@dataclass(frozen=True)
class Placement:
    """Where a checkpoint tensor goes on one rank.

    ``held`` False: the rank skips it (another rank's expert). ``split`` None: whole tensor.
    ``expert_slot``: its slot in the rank's local expert stack (expert tensors only).
    """

    held: bool = True
    split: Split | None = None
    expert_slot: int | None = None

    def local_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        return shape if self.split is None else self.split.local_shape(shape)

    def index(self, shape: tuple[int, ...]) -> tuple[slice, ...] | None:
        return None if self.split is None else self.split.index(shape)


NOT_HELD = Placement(held=False)


def _split(layout: RankLayout, dim: int, parts: int) -> Split | None:
    return None if parts == 1 else Split(dim, layout.tp_rank(parts), parts)


def _proj_dim(proj: str) -> int:
    """Column-parallel (output rows) for gate/up, row-parallel (input columns) for down."""
    return 1 if proj == "down_proj" else 0


def placement_of(name: str, layout: RankLayout, num_experts: int) -> Placement:
    """The rule: which part of checkpoint tensor ``name`` rank ``layout.rank`` holds."""
    p = layout.parallel
    if m := _EXPERT.search(name):
        return _expert_placement(int(m.group(1)), m.group(2), layout, num_experts)
    if _ATTN_COL.search(name):
        return Placement(split=_split(layout, 0, p.attn_tp_size))
    if _ATTN_ROW.search(name):
        return Placement(split=_split(layout, 1, p.attn_tp_size))
    if m := _SHARED.search(name):
        return Placement(split=_split(layout, _proj_dim(m.group(1)), p.attn_tp_size))
    if m := _DENSE.search(name):
        return Placement(split=_split(layout, _proj_dim(m.group(1)), p.dense_tp_size))
    if name.startswith("lm_head."):
        parts = p.lm_head_tp_size
        split = None if parts == 1 else Split(0, layout.tp_rank(parts), parts, padded=True)
        return Placement(split=split)
    return Placement()


def _expert_placement(expert: int, proj: str, layout: RankLayout, num: int) -> Placement:
    experts = layout.expert_range(num)
    if expert not in experts:
        return NOT_HELD
    split = _split(layout, _proj_dim(proj), layout.parallel.moe_tp_size)
    return Placement(split=split, expert_slot=expert - experts.start)


def check_split(
    name: str,
    shape: tuple[int, ...],
    placement: Placement,
    fp8: bool,
    weight_shape: tuple[int, ...] | None = None,
) -> None:
    """Refuse a split that is uneven, or that cuts an FP8 weight off a 128 boundary.

    A ``weight_scale_inv`` (one float32 per 128x128 block of its weight) gets its weight's
    :class:`Split`; pass its weight's full shape as ``weight_shape`` and the split is
    refused unless the weight's own split is 128-aligned, which is exactly when the scale's
    slice (``Split.index`` on the block count) holds the blocks of the weight's slice.
    """
    split = placement.split
    if split is None:
        return
    is_scale = fp8 and name.endswith("weight_scale_inv")
    if is_scale and weight_shape is not None:
        _check_scale_split(name, shape, weight_shape, split)
    size = shape[split.dim]
    if size % split.parts and not split.padded:
        raise LayoutError(
            f"{name}: dim {split.dim} of size {size} does not split into {split.parts} parts"
        )
    if fp8 and not is_scale and (size // split.parts) % BLOCK:
        raise LayoutError(
            f"{name}: an FP8 weight split {size} / {split.parts} = {size // split.parts} along "
            f"dim {split.dim} does not fall on a {BLOCK} boundary of its weight_scale_inv blocks"
        )


def _check_scale_split(
    name: str, shape: tuple[int, ...], weight_shape: tuple[int, ...], split: Split
) -> None:
    weight = name.removesuffix("_scale_inv")
    size, blocks = weight_shape[split.dim], shape[split.dim]
    if blocks != -(-size // BLOCK):
        raise LayoutError(
            f"{name}: expected {-(-size // BLOCK)} blocks along dim {split.dim} for {weight} "
            f"of size {size}, found {blocks}"
        )
    local = size // split.parts
    if size % split.parts or local % BLOCK:
        raise LayoutError(
            f"{name}: its weight {weight} splits {size} / {split.parts} = {size / split.parts:g} "
            f"along dim {split.dim}, not on a {BLOCK} boundary, so its blocks cannot be split"
        )
    first = split.rank * local // BLOCK
    if split.index(shape)[split.dim] != slice(first, first + local // BLOCK):
        raise LayoutError(f"{name}: scale blocks do not follow {weight}'s split {split}")


def check_model(parallel: ParallelConfig, cfg: ModelConfig) -> None:
    """Refuse a layout the model's dimensions cannot be split into, naming both."""
    checks = [
        ("num_attention_heads", cfg.num_attention_heads, parallel.attn_tp_size, "attention TP"),
        ("n_routed_experts", cfg.n_routed_experts, parallel.ep_size, "ep_size"),
        ("intermediate_size", cfg.intermediate_size, parallel.dense_tp_size, "dense TP"),
        ("moe_intermediate_size", cfg.moe_intermediate_size, parallel.moe_tp_size, "MoE TP"),
    ]
    for field, size, parts, what in checks:
        if size % parts:
            raise LayoutError(f"{field} {size} does not divide over {parts} ranks ({what})")
