"""How an app with ``slo`` set is bound and deployed under Serve's own autoscaling.

With ``slo`` set, each role gets ``max_replicas`` worker deployments (``prefill-0`` ..),
each of 0 or 1 replica under an ``autoscaling_config``; Serve's controller calls the
app-level policy :class:`router.autoscale.serve.PDAutoscaler` (``autoscaling_policy``,
set in the deploy config: Ray 2.60 takes an application-level policy only there) and
starts or stops them. The router follows which of them run and which the policy has
marked leaving (:class:`MembershipWatch`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping, Set
from dataclasses import dataclass
from typing import Any

from router.autoscale.board import read_leaving
from router.autoscale.metrics import AutoscaleMetrics
from router.config import ServingConfig
from router.routing.policy import ReplicaSet
from workers.protocol import Role

POLICY_PATH = "router.autoscale.serve:PDAutoscaler"
logger = logging.getLogger(__name__)


def worker_count(cfg: ServingConfig, role: Role) -> int:
    """How many worker deployments ``role`` binds: ``max_replicas`` when autoscaled."""
    group = cfg.prefill if role == "prefill" else cfg.decode if role == "decode" else None
    if cfg.slo is None or group is None:
        return getattr(cfg, role).num_replicas
    return group.bounds()[1]


def worker_autoscaling(cfg: ServingConfig, role: Role, index: int) -> dict[str, Any]:
    """Serve deployment options of worker deployment ``index`` of an autoscaled role: at
    most one replica, kept at one below the role's ``min_replicas``, started with one
    below ``num_replicas``; a stopping replica waits ``drain_timeout_s`` for its ongoing
    calls (decode streams, prefills) to finish."""
    group = getattr(cfg, role)
    low, _ = group.bounds()
    assert cfg.slo is not None
    return {
        "autoscaling_config": {
            "min_replicas": 1 if index < low else 0,
            "max_replicas": 1,
            "initial_replicas": 1 if index < group.num_replicas else 0,
            "metrics_interval_s": cfg.slo.metrics_interval_s,
            "look_back_period_s": cfg.slo.look_back_period_s,
            # Serve holds a custom policy's decisions for these too (600 s down by
            # default); the policy's own cooldown_s paces the changes instead.
            "upscale_delay_s": 0.0,
            "downscale_delay_s": 0.0,
        },
        "graceful_shutdown_timeout_s": cfg.slo.drain_timeout_s,
        "graceful_shutdown_wait_loop_s": 0.5,
    }


def autoscaling_policy(cfg: ServingConfig) -> dict[str, Any] | None:
    """The deploy config's ``autoscaling_policy`` for ``cfg`` (None: not autoscaled)."""
    if cfg.slo is None:
        return None
    return {
        "policy_function": POLICY_PATH,
        "policy_kwargs": {
            "ttft_p99_s": cfg.slo.ttft_p99_s,
            "itl_p99_s": cfg.slo.itl_p99_s,
            "bounds": {role: list(getattr(cfg, role).bounds()) for role in cfg.roles()},
            "cooldown_s": cfg.slo.cooldown_s,
            "leave_delay_s": cfg.slo.metrics_interval_s + 1.0,  # Serve's view catches up
            "drain_timeout_s": cfg.slo.drain_timeout_s,
        },
    }


def with_autoscaling_policy(app: Mapping[str, Any]) -> dict[str, Any]:
    """A deploy config's application entry with its ``autoscaling_policy`` filled in
    from its ``args`` (unchanged when it sets no ``slo``)."""
    policy = autoscaling_policy(ServingConfig.parse(dict(app.get("args") or {})))
    return dict(app) if policy is None else dict(app) | {"autoscaling_policy": policy}


@dataclass(frozen=True)
class Reading:
    """One membership reading: how many replicas of each deployment the router may choose,
    and the version of the policy's leaving set it reflects (0: none published)."""

    choosable: Mapping[str, int]
    version: int = 0


def running_replicas(app_name: str) -> dict[str, int]:
    """Running replicas of each deployment of ``app_name``, from Serve's status (a
    replica is RUNNING once its constructor returned and its health check passed)."""
    from ray import serve
    from ray.serve.schema import ReplicaState

    status = serve.status().applications.get(app_name)
    if status is None:
        return {}
    return {
        name: int(dep.replica_states.get(ReplicaState.RUNNING, 0))
        for name, dep in status.deployments.items()
    }


def choosable(running: Mapping[str, int], leaving: Set[str]) -> dict[str, int]:
    """``running`` with the deployments the policy marked leaving at 0: the router stops
    choosing one as soon as it leaves, while Serve still runs it for its requests."""
    return {name: 0 if name in leaving else count for name, count in running.items()}


class MembershipWatch:
    """Keeps each ReplicaSet's members equal to the worker deployments the router may
    choose: one joins once Serve reports it RUNNING, one leaves when it does not or when
    the policy marks it leaving. Once a reading is applied, ``ack`` tells the policy which
    leaving-set version this router follows now."""

    def __init__(
        self,
        sets: Mapping[str, ReplicaSet],
        read: Callable[[], Reading],
        period_s: float,
        metrics: AutoscaleMetrics | None = None,
        ack: Callable[[int], None] | None = None,
    ) -> None:
        self.sets = sets
        self.read = read
        self.period_s = period_s
        self.metrics = metrics
        self.ack = ack

    def apply(self, running: Mapping[str, int]) -> None:
        """One update from a ``{deployment: choosable replicas}`` reading."""
        for role, replica_set in self.sets.items():
            before = len(replica_set.members())
            replica_set.set_members(running)
            if self.metrics is not None:
                self.metrics.observe(role, before, replica_set)

    async def step(self) -> None:
        """Read, apply and acknowledge once; a failed reading keeps the last members (and
        acknowledges nothing)."""
        try:
            reading = await asyncio.to_thread(self.read)
            self.apply(reading.choosable)
            if self.ack is not None:
                await asyncio.to_thread(self.ack, reading.version)
        except Exception:  # Serve's controller busy or restarting: try next period
            logger.warning("replica membership: status read failed", exc_info=True)

    async def run(self) -> None:
        """A step every ``period_s`` until cancelled."""
        while True:
            await asyncio.sleep(self.period_s)
            await self.step()


def membership(app_name: str) -> Reading:
    """What a router of ``app_name`` may choose now: Serve's running worker deployments
    less those the policy's latest leaving set names (read first: a set read before the
    status never lets a stopped deployment back in)."""
    leaving = read_leaving(app_name)
    return Reading(choosable(running_replicas(app_name), leaving.leaving), leaving.version)
