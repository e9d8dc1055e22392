"""Ranks 1..N-1 of a worker group as Ray actors in the replica's placement group.

The Serve replica is rank 0 (placement group bundle 0); ``start_group`` places one
:class:`RankWorker` on each other bundle and joins them in one torch.distributed process
group (gloo on CPU, NCCL on GPU). Each follower then builds its shard of the model (while
rank 0 builds its own: they agree on the KV capacity) and follows rank 0's steps. The
placement group packs the bundles onto as few nodes as hold them, so a group of 16 ranks
of one GPU each spans two 8-GPU nodes.
"""

from __future__ import annotations

import socket
from typing import Any

import ray
from ray.util.placement_group import get_current_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from dsv3serve.engine.group import GroupSpec, init_group
from dsv3serve.engine.rank import run_follower
from workers.config import WorkerConfig


def _free_port(host: str) -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


@ray.remote
class RankWorker:
    """One follower rank: its shard of the model and its KV pool, driven by rank 0."""

    def __init__(self, config_json: str, spec: dict[str, Any]) -> None:
        import torch

        self.cfg = WorkerConfig.model_validate_json(config_json)
        if self.cfg.torch_threads:
            torch.set_num_threads(self.cfg.torch_threads)
        self.spec = GroupSpec(**spec)

    def join(self) -> None:
        """Join the process group (returns once every rank has joined)."""
        init_group(self.spec)

    def loop(self) -> int:
        """Build this rank's shard, then follow rank 0 until it stops the group."""
        return run_follower(self.cfg.engine)


class Group:
    """Rank 0's view of its group: the follower actors and (once the engine is built) the
    leader runner that drives them."""

    def __init__(self, followers: list[Any], loops: list[Any]) -> None:
        self.followers, self.loops = followers, loops
        self.leader: Any = None

    def stop(self) -> None:
        self.leader.stop()
        ray.get(self.loops, timeout=60)


def start_group(cfg: WorkerConfig) -> Group:
    """Place ranks 1..N-1, join all N ranks (this process is rank 0), start the followers.

    The followers build their shards as soon as they are started; rank 0 builds its own
    engine next (the caller), and the ranks agree on the KV capacity while building.
    """
    size = cfg.group_size
    gpu = cfg.engine.device.startswith("cuda")
    host = ray.util.get_node_ip_address()
    spec = GroupSpec(0, size, host, _free_port(host), "nccl" if gpu else "gloo")
    follower_cfg = cfg.model_dump_json()
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
    return Group(followers, loops)
