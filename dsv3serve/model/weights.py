"""Load HF-format DeepSeek-V3 safetensors into the model, or fill it with dummy weights.

Shards are opened with safetensors' memory mapping and consumed one tensor at a time,
so peak host memory stays near one tensor beyond the model itself.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal, Protocol

import torch

from dsv3serve.config import ModelConfig
from dsv3serve.kernels.fp8_ref import FP8_DTYPE
from dsv3serve.layers.load_target import LoadTarget
from dsv3serve.model.deepseek_v3 import DeepseekV3ForCausalLM
from dsv3serve.model.shard_load import iter_local, read_index
from dsv3serve.parallel.shard import RankLayout
from dsv3serve.parallel.shard_tensors import LocalTensor, local_tensors

LoadFormat = Literal["auto", "safetensors", "dummy"]
INDEX_FILE = "model.safetensors.index.json"


class WeightLoadError(ValueError):
    """A checkpoint does not match the model: missing, unexpected or wrongly shaped tensors."""


class CheckpointModel(Protocol):
    """What the loader needs of a model (local shapes when built for a ``RankLayout``)."""

    cfg: ModelConfig

    def checkpoint_targets(self) -> dict[str, LoadTarget]: ...

    def ignored_checkpoint_names(self) -> tuple[str, ...]: ...

    def post_load(self) -> None: ...


def shard_files(model_dir: Path) -> list[Path]:
    """The checkpoint's safetensors files: from the index if present, else all ``*.safetensors``."""
    index = model_dir / INDEX_FILE
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [model_dir / f for f in sorted(set(weight_map.values()))]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise WeightLoadError(f"no *.safetensors files and no {INDEX_FILE} in {model_dir}")
    return files


def _copy_into(name: str, target: LoadTarget, tensor: torch.Tensor) -> None:
    dst = target.view()
    if tuple(dst.shape) != tuple(tensor.shape):
        raise WeightLoadError(
            f"expected shape {list(dst.shape)} for {name}, got {list(tensor.shape)}"
        )
    if (dst.dtype == FP8_DTYPE) != (tensor.dtype == FP8_DTYPE):
        raise WeightLoadError(f"expected dtype {dst.dtype} for {name}, got {tensor.dtype}")
    dst.copy_(tensor)


def load_checkpoint(
    model: CheckpointModel, model_dir: str | Path, layout: RankLayout | None = None
) -> None:
    """Fill every model parameter from ``model_dir``; fail naming what does not match.

    With ``layout``, only the rank's part is read (``placement_of``): other ranks' experts
    are skipped unread and split tensors are read as their slice. The layout and the
    checkpoint's names are checked against the model before any tensor data is read.
    """
    model_dir = Path(model_dir)
    index = read_index(shard_files(model_dir))
    skip = model.ignored_checkpoint_names()
    local = local_tensors(index, layout, model.cfg.n_routed_experts, skip)
    targets = model.checkpoint_targets()
    _check_names(model_dir, targets, local)
    for name, tensor in iter_local(model_dir, local):
        _copy_into(name, targets[name], tensor)
    model.post_load()


def _check_names(model_dir: Path, targets: dict[str, LoadTarget], local: list[LocalTensor]) -> None:
    """Missing: a target the rank's part lacks. Unexpected: a held tensor with no target
    (tensors of other ranks and ignored copies are neither)."""
    held = {t.name for t in local}
    missing = sorted(set(targets) - held)
    unexpected = sorted(held - set(targets))
    if missing or unexpected:
        raise WeightLoadError(
            f"checkpoint {model_dir} does not match the model: "
            f"missing {len(missing)} tensors {missing[:8]}, "
            f"unexpected {len(unexpected)} tensors {unexpected[:8]}"
        )


DUMMY_CHUNK_ELEMENTS = 1 << 26  # 256 MiB of float32 scratch per chunk


@torch.no_grad()
def fill_randn_(t: torch.Tensor, generator: torch.Generator, std: float = 1.0) -> torch.Tensor:
    """Fill ``t`` in place with N(0, std) values on its own device, any float dtype.

    e4m3 has no in-place normal, so values are drawn in float32 a chunk at a time and
    cast: the scratch stays at ``DUMMY_CHUNK_ELEMENTS`` however large ``t`` is (a full
    DeepSeek-V3 expert stack is 7.5e9 values). ``t`` must be contiguous.
    """
    if t.dtype != FP8_DTYPE:
        return t.normal_(0.0, std, generator=generator)
    for chunk in t.view(-1).split(DUMMY_CHUNK_ELEMENTS):
        values = torch.randn(chunk.shape, generator=generator, device=t.device)
        chunk.copy_(values.mul_(std) if std != 1.0 else values)
    return t


@torch.no_grad()
def init_dummy(model: DeepseekV3ForCausalLM, seed: int = 0, std: float = 0.02) -> None:
    """Random weights of the right dtypes, generated directly on the model's device."""
    gen_device = next(model.parameters()).device
    g = torch.Generator(device=gen_device).manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.fill_(1.0)
        elif name.endswith("e_score_correction_bias"):
            p.normal_(0.0, 0.01, generator=g)
        elif name.endswith("scale_inv"):
            p.fill_(std)  # fp8 values ~N(0, 1) times std give weights ~N(0, std)
        else:
            fill_randn_(p, g, 1.0 if p.dtype == FP8_DTYPE else std)
    model.post_load()


def load_weights(
    model: DeepseekV3ForCausalLM,
    model_dir: str | Path | None,
    load_format: LoadFormat = "auto",
    layout: RankLayout | None = None,
) -> None:
    """Load real weights from ``model_dir`` (the rank's part with ``layout``) or, with
    ``load_format="dummy"``, random ones into whatever local parameters the model has."""
    if load_format == "dummy":
        init_dummy(model)
        return
    if model_dir is None:
        raise WeightLoadError("a model directory is required unless load_format='dummy'")
    load_checkpoint(model, model_dir, layout)
