"""Ranks 1..N-1 of a worker group as Ray actors in the replica's placement group.

The Serve replica is rank 0 (placement group bundle 0); ``start_group`` places one
:class:`RankWorker` on each other bundle, joins them in one torch.distributed process
group (gloo on CPU, NCCL on GPU) and starts their lockstep loops.
"""

from __future__ import annotations

import socket
from typing import Any

import ray
from ray.util.placement_group import get_current_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from dsv3serve.engine.group import GroupLeader, GroupSpec, follower_loop, init_group
from workers.config import WorkerConfig


def _free_port(host: str) -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


@ray.remote
class RankWorker:
    """One follower rank: its own model replica and KV pool, driven by rank 0."""

    def __init__(self, config_json: str, spec: dict[str, Any]) -> None:
        import torch

        from dsv3serve.config import ModelConfig
        from dsv3serve.engine.engine import resolve_model_dir
        from dsv3serve.engine.model_runner import ModelRunner

        cfg = WorkerConfig.model_validate_json(config_json)
        if cfg.torch_threads:
            torch.set_num_threads(cfg.torch_threads)
        self.spec = GroupSpec(**spec)
        model_dir = resolve_model_dir(cfg.engine)
        self.runner = ModelRunner(cfg.engine, model_dir, ModelConfig.from_hf(model_dir))

    def join(self) -> None:
        """Join the process group (returns once every rank has joined)."""
        init_group(self.spec)

    def loop(self) -> int:
        """Follow rank 0 until it stops the group; returns the steps run."""
        return follower_loop(self.runner)


class Group:
    """Rank 0's view of its group: the leader runner and the follower actors."""

    def __init__(self, leader: GroupLeader, followers: list[Any], loops: list[Any]) -> None:
        self.leader, self.followers, self.loops = leader, followers, loops

    def stop(self) -> None:
        self.leader.stop()
        ray.get(self.loops, timeout=60)


def start_group(cfg: WorkerConfig, runner: Any) -> Group:
    """Place ranks 1..N-1, join all N ranks, and wrap ``runner`` (rank 0) as the leader.

    Followers get rank 0's exact KV capacity so every pool has the same pages.
    """
    size = cfg.group_size
    gpu = cfg.engine.device.startswith("cuda")
    host = ray.util.get_node_ip_address()
    spec = GroupSpec(0, size, host, _free_port(host), "nccl" if gpu else "gloo")
    engine = cfg.engine.model_copy(
        update={"num_kv_tokens": runner.num_pages * cfg.engine.page_size}
    )
    follower_cfg = cfg.model_copy(update={"engine": engine}).model_dump_json()
    pg = get_current_placement_group()
    followers = [
        RankWorker.options(
            num_cpus=0,
            num_gpus=1 if gpu else 0,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                pg, placement_group_bundle_index=rank
            )
            if pg is not None
            else "DEFAULT",
        ).remote(follower_cfg, {**spec.__dict__, "rank": rank})
        for rank in range(1, size)
    ]
    joins = [f.join.remote() for f in followers]
    init_group(spec)
    ray.get(joins)
    loops = [f.loop.remote() for f in followers]
    return Group(GroupLeader(runner, size), followers, loops)
