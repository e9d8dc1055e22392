"""Load HF-format DeepSeek-V3 safetensors into the model, or fill it with dummy weights.

Shards are opened with safetensors' memory mapping and consumed one tensor at a time,
so peak host memory stays near one tensor beyond the model itself.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

import torch
from safetensors import safe_open

from dsv3serve.kernels.fp8_ref import FP8_DTYPE
from dsv3serve.layers.load_target import LoadTarget
from dsv3serve.model.deepseek_v3 import DeepseekV3ForCausalLM

LoadFormat = Literal["auto", "safetensors", "dummy"]
INDEX_FILE = "model.safetensors.index.json"


class WeightLoadError(ValueError):
    """A checkpoint does not match the model: missing, unexpected or wrongly shaped tensors."""


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


def iter_checkpoint(model_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` for every tensor, shard by shard, memory-mapped."""
    for file in shard_files(model_dir):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                yield name, f.get_tensor(name)


def _copy_into(name: str, target: LoadTarget, tensor: torch.Tensor) -> None:
    dst = target.view()
    if tuple(dst.shape) != tuple(tensor.shape):
        raise WeightLoadError(
            f"expected shape {list(dst.shape)} for {name}, got {list(tensor.shape)}"
        )
    if (dst.dtype == FP8_DTYPE) != (tensor.dtype == FP8_DTYPE):
        raise WeightLoadError(f"expected dtype {dst.dtype} for {name}, got {tensor.dtype}")
    dst.copy_(tensor)


def load_checkpoint(model: DeepseekV3ForCausalLM, model_dir: str | Path) -> None:
    """Fill every model parameter from ``model_dir``; fail naming what does not match."""
    targets = model.checkpoint_targets()
    ignored = model.ignored_checkpoint_names()
    seen: set[str] = set()
    unexpected: list[str] = []
    for name, tensor in iter_checkpoint(Path(model_dir)):
        target = targets.get(name)
        if target is None:
            if not name.startswith(ignored):
                unexpected.append(name)
            continue
        _copy_into(name, target, tensor)
        seen.add(name)
    missing = sorted(set(targets) - seen)
    if missing or unexpected:
        raise WeightLoadError(
            f"checkpoint {model_dir} does not match the model: "
            f"missing {len(missing)} tensors {missing[:8]}, "
            f"unexpected {len(unexpected)} tensors {sorted(unexpected)[:8]}"
        )
    model.post_load()


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
    model: DeepseekV3ForCausalLM, model_dir: str | Path | None, load_format: LoadFormat = "auto"
) -> None:
    """Load real weights from ``model_dir`` or, with ``load_format="dummy"``, random ones."""
    if load_format == "dummy":
        init_dummy(model)
        return
    if model_dir is None:
        raise WeightLoadError("a model directory is required unless load_format='dummy'")
    load_checkpoint(model, model_dir)
