"""Ranks 1..N-1 of a worker group as Ray actors in the replica's placement group.

The Serve replica is rank 0 (placement group bundle 0); ``start_group`` places one
:class:`RankWorker` on each other bundle and joins them in one torch.distributed process
group (gloo on CPU, NCCL on GPU). Each follower then builds its shard of the model (while
rank 0 builds its own: they agree on the KV capacity) and follows rank 0's steps. The
placement group packs the bundles onto as few nodes as hold them, so a group of 16 ranks
of one GPU each spans two 8-GPU nodes.

Metrics: each follower answers :meth:`RankWorker.dispatch_stats` (its dispatch meters as
plain numbers) in a concurrency group of its own, so the call is served while ``loop`` runs;
rank 0 starts asking every follower when it is scraped and exports the last answers
(:meth:`Group.dispatch_stats`). The step protocol between the ranks is unchanged.

The followers are actors the replica owns: they die with it. A follower that dies first
ends its ``loop`` call; :meth:`Group.check` (the replica's health check) reports it, and
rank 0's next collective raises (connection closed, or ``group_timeout_s``).
"""

from __future__ import annotations

import asyncio
import socket
from concurrent.futures import Future
from dataclasses import replace
from typing import Any

import ray
from ray import ObjectRef
from ray.actor import ActorHandle
from ray.util.placement_group import PlacementGroup, get_current_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from dsv3serve.engine.group.dp import DPGroupLeader
from dsv3serve.engine.group.rank import run_follower
from dsv3serve.engine.group.tp import GroupLeader, GroupSpec, init_group, rank_timeout_s
from dsv3serve.json_types import JSONObject
from dsv3serve.parallel.dispatch_meter import process_snapshots
from workers.config import WorkerConfig


class GroupRankDiedError(RuntimeError):
    """A follower rank of this replica's group ended while rank 0 still drives it."""


def _free_port(host: str) -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def rank_actor_name(group_name: str, rank: int) -> str:
    """The Ray actor name of follower ``rank`` of the group named ``group_name``."""
    return f"dsv3serve-rank{rank}:{group_name}"


@ray.remote(concurrency_groups={"metrics": 1})  # type: ignore[call-overload]  # Ray's overloads omit it
class RankWorker:
    """One follower rank: its shard of the model and its KV pool, driven by rank 0."""

    def __init__(self, config_json: str, spec: dict[str, Any]) -> None:  # GroupSpec's fields
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

    @ray.method(concurrency_group="metrics")
    def dispatch_stats(self) -> list[JSONObject]:
        """This rank's dispatch / combine meters (``dispatch_meter`` snapshots), answered on
        a thread of their own while ``loop`` runs; empty before the shard is built."""
        return process_snapshots()


class Group:
    """Rank 0's view of its group: the follower actors and (once the engine is built) the
    leader runner that drives them."""

    def __init__(self, followers: list[ActorHandle], loops: list[ObjectRef[int]]) -> None:
        self.followers, self.loops = followers, loops
        self._ends: list[Future[int]] = [ref.future() for ref in loops]
        self.leader: GroupLeader | DPGroupLeader | None = None
        self._stats: list[JSONObject] = []
        self._asking: asyncio.Future[None] | None = None

    def driver(self) -> GroupLeader | DPGroupLeader:
        """The leader runner; RuntimeError before rank 0's engine is built."""
        if self.leader is None:
            raise RuntimeError("expected the group's leader runner, found none yet")
        return self.leader

    def dp_driver(self) -> DPGroupLeader:
        """The leader runner of a DP-attention group; TypeError for a TP group's."""
        leader = self.driver()
        if not isinstance(leader, DPGroupLeader):
            raise TypeError(f"expected a DP-attention leader, found {type(leader).__name__}")
        return leader

    def dispatch_stats(self, timeout_s: float = 5.0) -> list[JSONObject]:
        """The followers' dispatch meter snapshots as last answered, and a new ask of every
        follower started in the background unless one is under way (call it from the
        replica's event loop). The scrape never waits on a follower: its numbers are one
        ask behind. A follower that does not answer within ``timeout_s`` (or died:
        :meth:`check` reports that) leaves the last answers in place, so counters never go
        back."""
        if self._asking is None or self._asking.done():
            self._asking = asyncio.ensure_future(self._ask(timeout_s))
        return self._stats

    async def _ask(self, timeout_s: float) -> None:
        refs = [f.dispatch_stats.remote() for f in self.followers]
        try:
            per_rank = await asyncio.wait_for(asyncio.gather(*refs), timeout_s)
        except (TimeoutError, ray.exceptions.RayError):
            return
        self._stats = [snap for snaps in per_rank for snap in snaps]

    def check(self) -> None:
        """Raise :class:`GroupRankDiedError` if a follower's loop has ended (its actor died,
        or its loop raised); never blocks."""
        for rank, end in enumerate(self._ends, start=1):
            if end.done():
                error = end.exception()
                why = f"{type(error).__name__}: {error}" if error else f"returned {end.result()}"
                raise GroupRankDiedError(
                    f"group rank {rank} ended while rank 0 still drives it ({why})"
                )

    def stop(self) -> None:
        if self.leader is not None:
            self.leader.stop()
        ray.get(self.loops, timeout=60)


def _place(pg: PlacementGroup | None, rank: int) -> PlacementGroupSchedulingStrategy | str:
    if pg is None:
        return "DEFAULT"
    return PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=rank)


def _spawn(cfg: WorkerConfig, spec: GroupSpec, rank: int, name: str) -> ActorHandle:
    """Follower ``rank``'s actor on bundle ``rank`` of this replica's placement group."""
    options: dict[str, int | str] = {"num_cpus": 0, "num_gpus": 1 if spec.backend == "nccl" else 0}
    if name:
        options["name"] = rank_actor_name(name, rank)
    mine = replace(spec, rank=rank, timeout_s=rank_timeout_s(rank, spec.timeout_s))
    place = _place(get_current_placement_group(), rank)
    # mypy keeps a decorated class's own type: RankWorker is Ray's ActorClass
    actor = RankWorker.options(scheduling_strategy=place, **options)  # type: ignore[attr-defined]
    return actor.remote(cfg.model_dump_json(), mine.__dict__)


def start_group(cfg: WorkerConfig, name: str = "") -> Group:
    """Place ranks 1..N-1, join all N ranks (this process is rank 0), start the followers.

    The followers build their shards as soon as they are started; rank 0 builds its own
    engine next (the caller), and the ranks agree on the KV capacity while building.
    ``name`` (unique among live groups, e.g. the replica's id) names the follower actors
    :func:`rank_actor_name` (``name`` empty: unnamed).
    """
    host = ray.util.get_node_ip_address()
    backend = "nccl" if cfg.engine.device.startswith("cuda") else "gloo"
    spec = GroupSpec(0, cfg.group_size, host, _free_port(host), backend, cfg.group_timeout_s)
    followers = [_spawn(cfg, spec, rank, name) for rank in range(1, cfg.group_size)]
    joins = [f.join.remote() for f in followers]
    init_group(spec)
    ray.get(joins)
    return Group(followers, [f.loop.remote() for f in followers])
