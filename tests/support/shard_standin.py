"""A stand-in for the sharded model (until the ``model`` branch builds local shapes itself).

``LocalShapeStandIn`` holds, for one rank, a parameter of the local shape of every
checkpoint tensor the rank holds per ``placement_of``, routed experts stacked per layer and
projection ``[n_local, *local_shape]`` at their ``expert_slot``, as the real model will.
Names, full shapes and dtypes come from ``safe_open`` (not from the loader's header reader).
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from dsv3serve.config import ModelConfig
from dsv3serve.layers.load_target import LoadTarget
from dsv3serve.model.weights import shard_files
from dsv3serve.parallel.config import ParallelConfig
from dsv3serve.parallel.shard import RankLayout, placement_of

# Checkpoints whose FP8 projections split on 128 boundaries over 2 ranks (heads 4 x 128 q/k,
# 4 x 64 v, experts 256 wide); small vocabulary: loader tests need no real tokenizer size.
ALIGNED_TP2 = {
    "vocab_size": 512,
    "qk_nope_head_dim": 64,
    "qk_rope_head_dim": 64,
    "v_head_dim": 64,
    "moe_intermediate_size": 256,
}
SMALL = {"vocab_size": 512}


def checkpoint_meta(model_dir: Path) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """``{name: (full shape, dtype)}`` through safetensors' own API."""
    meta: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    for file in shard_files(model_dir):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                sl = f.get_slice(name)
                dtype = getattr(torch, _TORCH_DTYPE[sl.get_dtype()])
                meta[name] = (tuple(sl.get_shape()), dtype)
    return meta


_TORCH_DTYPE = {"F8_E4M3": "float8_e4m3fn", "BF16": "bfloat16", "F32": "float32"}


def nextn_copies(cfg: ModelConfig) -> tuple[str, ...]:
    mtp = f"model.layers.{cfg.num_hidden_layers}"
    return (f"{mtp}.embed_tokens.", f"{mtp}.shared_head.head.")


class LocalShapeStandIn(nn.Module):
    """One rank's parameters of local shape; ``checkpoint_targets`` as the real model's."""

    def __init__(self, model_dir: Path, layout: RankLayout | None) -> None:
        super().__init__()
        self.cfg = ModelConfig.from_hf(model_dir)
        self.layout = layout or RankLayout(ParallelConfig())
        self.params = nn.ParameterDict()
        self.targets: dict[str, LoadTarget] = {}
        self.post_load_calls = 0
        for name, (shape, dtype) in checkpoint_meta(model_dir).items():
            if not name.startswith(nextn_copies(self.cfg)):
                self._add(name, shape, dtype)

    def _add(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        placement = placement_of(name, self.layout, self.cfg.n_routed_experts)
        if not placement.held:
            return
        local = placement.local_shape(shape)
        if placement.expert_slot is None:
            key = name.replace(".", "__")
            self.params[key] = _empty(local, dtype)
            self.targets[name] = LoadTarget(self.params[key])
            return
        key = _expert_stack_key(name)
        if key not in self.params:
            slots = self.cfg.n_routed_experts // self.layout.parallel.ep_size
            self.params[key] = _empty((slots, *local), dtype)
        self.targets[name] = LoadTarget(self.params[key], (placement.expert_slot,))

    def checkpoint_targets(self) -> dict[str, LoadTarget]:
        return dict(self.targets)

    def ignored_checkpoint_names(self) -> tuple[str, ...]:
        return nextn_copies(self.cfg)

    def post_load(self) -> None:
        self.post_load_calls += 1


def _expert_stack_key(name: str) -> str:
    """``model.layers.3.mlp.experts.11.up_proj.weight`` -> ``model__layers__3__up_proj__weight``"""
    parts = name.split(".")
    return "__".join(parts[:3] + parts[6:])


def _empty(shape: tuple[int, ...], dtype: torch.dtype) -> nn.Parameter:
    nan = torch.full(shape, float("nan")).to(dtype)  # unloaded values stay visible
    return nn.Parameter(nan, requires_grad=False)
