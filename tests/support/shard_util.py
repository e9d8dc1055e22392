"""Helpers for sharded-model tests: fill a rank's shard from the full checkpoint tensors,
a gather-everything test double of the Dispatcher, and a multi-process gloo runner.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from http_util import spare_port
from rank_procs import start_ranks
from safetensors import safe_open

from dsv3serve.model.deepseek_v3 import DeepseekV3ForCausalLM
from dsv3serve.model.weights import shard_files
from dsv3serve.parallel.comm import Comm
from dsv3serve.parallel.dispatch_base import Dispatched, Dispatcher
from dsv3serve.parallel.shard import Placement, RankLayout, placement_of


def _placement(model: DeepseekV3ForCausalLM, name: str) -> Placement:
    layout = model.opts.layout
    if layout is None:
        return Placement()
    return placement_of(name, layout, model.cfg.n_routed_experts)


def copy_shards_from_full(model: DeepseekV3ForCausalLM, full: dict[str, torch.Tensor]) -> None:
    """Fill ``model`` (one rank's shard) from the full checkpoint tensors: each target gets
    ``placement_of``'s slice (``Split.index``); every other name must be one the model
    lists as not held (and the rule agrees) or ignored. Stand-in for the sharded loader."""
    targets = model.checkpoint_targets()
    not_held, ignored = model.not_held_checkpoint_names(), model.ignored_checkpoint_names()
    for name, tensor in full.items():
        placement = _placement(model, name)
        if name in targets:
            index = placement.index(tuple(tensor.shape))
            src = tensor if index is None else tensor[index]
            dst = targets[name].view()
            if dst.shape != src.shape:
                raise AssertionError(f"{name}: target {list(dst.shape)}, slice {list(src.shape)}")
            dst.copy_(src)
        elif name in not_held:
            assert not placement.held, f"{name} listed as not held, but placement_of holds it"
        elif not name.startswith(ignored):
            raise AssertionError(f"checkpoint tensor {name} is neither loaded nor expected absent")
    missing = sorted(set(targets) - set(full))
    assert not missing, f"targets missing from the checkpoint: {missing[:8]}"
    model.post_load()


def read_full_checkpoint(model_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint, whole (tiny checkpoints only)."""
    out: dict[str, torch.Tensor] = {}
    for file in shard_files(model_dir):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                out[name] = f.get_tensor(name)
    return out


class GatherAllDispatcher(Dispatcher):
    """TEST DOUBLE of a Dispatcher (no all-to-all): every rank gathers every rank's tokens
    (padded to the largest count), keeps the choices of its own experts, and ``combine``
    all-reduces the per-expert sums and slices out this rank's tokens. Correct, not fast."""

    def __init__(self, comm: Comm, layout: RankLayout, num_experts: int) -> None:
        self.comm = comm
        self.experts = layout.expert_range(num_experts)
        self.num_local_experts = len(self.experts)

    def dispatch(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor):
        xs, counts = self.comm.all_gather_rows(x)
        ids, _ = self.comm.all_gather_rows(topk_ids)
        weights, _ = self.comm.all_gather_rows(topk_weights.float())
        local = ids - self.experts.start
        real = _real_rows(counts)
        held = real[:, None] & (local >= 0) & (local < len(self.experts))
        local_ids = torch.where(held, local, -1)
        return Dispatched(xs, local_ids, torch.where(held, weights, 0.0), state=counts)

    def combine(self, y: torch.Tensor, dispatched: Dispatched) -> torch.Tensor:
        counts = dispatched.state
        total = self.comm.all_reduce(y.clone())
        start = self.comm.rank * max(counts)
        return total[start : start + counts[self.comm.rank]]


def _real_rows(counts: list[int]) -> torch.Tensor:
    """Which rows of an ``all_gather_rows`` result are real (not padding): [world * max]."""
    most = max(counts)
    return torch.arange(most).repeat(len(counts)) < torch.tensor(counts).repeat_interleave(most)


def free_port() -> int:
    """The gloo rendezvous port (``http_util.spare_port``: none other takes it meanwhile)."""
    return spare_port()


def _entry(rank: int, world: int, port: int, fn: Callable[..., None], args: tuple) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=120),
    )
    try:
        fn(rank, *args)
    finally:
        dist.destroy_process_group()


def run_ranks(world: int, fn: Callable[..., None], *args: Any) -> None:
    """Run ``fn(rank, *args)`` in ``world`` spawned processes joined by a gloo group;
    raises if any rank fails. ``fn`` must be importable (a module-level function)."""
    start_ranks(_entry, (world, free_port(), fn, args), world)
