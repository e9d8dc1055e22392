"""The SLO policies (router/autoscale/decisions.py) as a Ray Serve application-level autoscaling
policy over the app's per-replica worker deployments (``prefill-0``, ``decode-1``, ...).

Each worker deployment runs 0 or 1 replica; a role's replica count is how many of its
deployments run one. Serve's controller calls :class:`PDAutoscaler` with every
deployment's :class:`AutoscalingContext`; the workers' ``record_autoscaling_stats``
metrics (names in :data:`PREFILL_METRICS` / :data:`DECODE_METRICS`) reach it through
``ctx.aggregated_metrics``. It returns, per worker deployment, 1 for the first N of the
role and 0 for the rest (a running one only once it has left), and keeps the decision's
reason in the policy state.

``router/autoscale/app.py`` binds the deployments and names this class in the deploy
config's ``autoscaling_policy``. Serve calls it every control-loop tick; a role's count
changes at most once per ``cooldown_s`` (the policy, not Serve, keeps that time), never
up again while the last up's replicas start, and not down again where it just bounced
(``decisions.settled``). A deployment the policy stops leaves first: routers are told
(``router.autoscale.board``) and Serve gets its 0 once they let go (``leaving.Leaves``).
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Mapping, Set
from typing import Protocol

from ray.serve._private.common import DeploymentID
from ray.serve.config import AutoscalingContext
from ray.util.metrics import Counter

from router.autoscale.board import Publisher
from router.autoscale.decisions import (
    Bounds,
    Decision,
    DecodeSnapshot,
    Move,
    PolicyKnobs,
    PrefillSnapshot,
    decode_decision,
    prefill_decision,
    settled,
)
from router.autoscale.leaving import Leaves, ServeView, Versions

PREFILL_METRICS = ("queued_prompt_tokens", "prefill_tokens_per_s", "ttft_p99_s")
DECODE_METRICS = ("kv_usage", "running", "itl_p99_s")
_WORKER = re.compile(r"^(prefill|decode)-(\d+)$")
ROUTER = "router"  # router.app.ROUTER_NAME (not imported: this runs in Serve's controller)
BOUNCE_HOLD_COOLDOWNS = 10  # after a bounce a role keeps its count this many cooldowns

PolicyState = dict[str, str | int]
logger = logging.getLogger("ray.serve")


class LeavingSink(Protocol):
    """Where the policy sends the leaving set and reads the routers' acknowledgements
    (``board.Publisher``; a fake in tests)."""

    version: int  # of the set last sent

    def publish(self, leaving: Set[str]) -> None: ...

    def acked(self, readers: Set[str]) -> int: ...


class PDAutoscaler:
    """Serve app-level policy: ``policy_kwargs`` are the SLO targets and each role's
    ``[min, max]`` replicas, e.g. ``{"ttft_p99_s": 2, "itl_p99_s": 0.1, "bounds":
    {"prefill": [1, 3], "decode": [1, 2]}}``; ``leave_delay_s``: the least a leaving
    deployment is kept after it is marked (Serve's view of the requests sent to it just
    before catches up); ``drain_timeout_s``: the longest it is kept for its requests."""

    def __init__(
        self,
        ttft_p99_s: float,
        itl_p99_s: float,
        bounds: Mapping[str, list[int]],
        cooldown_s: float = 0.0,
        leave_delay_s: float = 3.0,
        drain_timeout_s: float = 120.0,
    ) -> None:
        self.ttft_p99_s = ttft_p99_s
        self.itl_p99_s = itl_p99_s
        self.bounds = {role: Bounds(low, high) for role, (low, high) in bounds.items()}
        self.knobs = PolicyKnobs()
        self.cooldown_s = cooldown_s
        self.started = time.monotonic()  # the first change waits a cooldown too
        self.changed_at: dict[str, float] = {}
        self.current: dict[str, int] = {}  # staying deployments Serve runs or starts
        self.starting: dict[str, bool] = {}  # some of them have no running replica yet
        self.decided: dict[str, int] = {}  # as this policy last set it
        self.moves: dict[str, list[Move]] = {}
        self.leaves = Leaves(leave_delay_s, drain_timeout_s)
        self.publisher: LeavingSink | None = None  # a Publisher for the app, on first call
        self.decisions = Counter(
            "dsv3serve_autoscale_decisions",
            description="Replica-count changes the PD autoscaling policy made, by reason.",
            tag_keys=("role", "reason", "direction"),
        )

    def __call__(
        self, contexts: dict[DeploymentID, AutoscalingContext]
    ) -> tuple[dict[DeploymentID, int], dict[DeploymentID, PolicyState]]:
        targets: dict[DeploymentID, int] = {}
        states: dict[DeploymentID, PolicyState] = {}
        if not contexts:
            return targets, states
        board = self.publisher = self.publisher or Publisher(next(iter(contexts)).app_name)
        seen = Versions(board.version + 1, board.acked(_routers(contexts)))
        for role, members in _by_role(contexts).items():
            staying = [contexts[d] for d in members if d.name not in self.leaves.started]
            decision = self.held(role, self.decide(role, staying))
            for index, dep in enumerate(members):
                want = 1 if index < decision.replicas else 0
                targets[dep] = self.leave_or_stay(contexts[dep], want, seen)
                states[dep] = {"reason": decision.reason, "role_replicas": decision.replicas}
        board.publish(self.leaves.leaving())
        return targets, states

    def leave_or_stay(self, ctx: AutoscalingContext, want: int, seen: Versions) -> int:
        """What Serve gets for a worker deployment the policy ``want``s at 0 or 1: a
        running one it wants at 0 leaves first (``leaving.Leaves``)."""
        leaving = want < 1 and ctx.target_num_replicas >= 1
        ongoing = ctx.total_num_requests if leaving else 0.0  # Serve computes it on read
        view = ServeView(ctx.target_num_replicas, ctx.current_num_replicas, ongoing)
        return self.leaves.target(ctx.deployment_name, want, view, time.monotonic(), seen)

    def held(self, role: str, decision: Decision) -> Decision:
        """``decision``, or the role's last decided count while it is in its cooldown (the
        decided count, not the reported one: Serve may not have applied it yet) or its
        hysteresis holds it (``decisions.settled``)."""
        now = time.monotonic()
        last = self.decided.setdefault(role, self.current[role])
        hold_s = BOUNCE_HOLD_COOLDOWNS * self.cooldown_s
        moves = self.moves.setdefault(role, [])
        decision = settled(decision, last, self.starting[role], moves, now, hold_s)
        if decision.replicas == last:
            return decision
        if now - self.changed_at.get(role, self.started) < self.cooldown_s:
            return Decision(last, "steady")
        self.changed_at[role] = now
        self.decided[role] = decision.replicas
        moves[:] = [m for m in moves if now - m[0] <= hold_s] + [(now, decision.replicas)]
        direction = "up" if decision.replicas > last else "down"
        tags = {"role": role, "reason": decision.reason, "direction": direction}
        self.decisions.inc(1.0, tags=tags)
        logger.info(f"autoscale {role}: {last} -> {decision.replicas} ({decision.reason})")
        return decision

    def decide(self, role: str, members: list[AutoscalingContext]) -> Decision:
        """The role's decision from its staying deployments' contexts (in index order)."""
        started = [ctx for ctx in members if ctx.target_num_replicas >= 1]
        replicas = len(started)
        self.current[role] = replicas
        self.starting[role] = any(ctx.current_num_replicas < 1 for ctx in started)
        bounds = self.bounds.get(role, Bounds(replicas, replicas))
        if role == "prefill":
            snap = prefill_snapshot(replicas, members)
            return prefill_decision(snap, self.ttft_p99_s, bounds, self.knobs)
        return decode_decision(
            decode_snapshot(replicas, members), self.itl_p99_s, bounds, self.knobs
        )


def _routers(contexts: Mapping[DeploymentID, AutoscalingContext]) -> set[str]:
    """The running router replicas' ids: each acknowledges the leaving sets it applied."""
    return {
        replica.unique_id
        for dep, ctx in contexts.items()
        if dep.name == ROUTER
        for replica in ctx.running_replicas
    }


def _by_role(contexts: Mapping[DeploymentID, AutoscalingContext]) -> dict[str, list[DeploymentID]]:
    """Worker deployments by role, in index order; other deployments (the router) left out."""
    roles: dict[str, list[tuple[int, DeploymentID]]] = {}
    for dep in contexts:
        match = _WORKER.match(dep.name)
        if match:
            roles.setdefault(match[1], []).append((int(match[2]), dep))
    return {role: [dep for _, dep in sorted(found)] for role, found in roles.items()}


def _values(members: list[AutoscalingContext], name: str) -> list[float]:
    """Every running replica's value of custom metric ``name``."""
    found: list[float] = []
    for ctx in members:
        per_replica = (ctx.aggregated_metrics or {}).get(name, {})
        found.extend(float(v) for v in per_replica.values())
    return found


def _worst(values: list[float]) -> float | None:
    return max(values) if values else None


def prefill_snapshot(replicas: int, members: list[AutoscalingContext]) -> PrefillSnapshot:
    """Queued tokens summed, throughput averaged over replicas that measured one, the
    worst p99 TTFT."""
    rates = [v for v in _values(members, "prefill_tokens_per_s") if v > 0]
    return PrefillSnapshot(
        replicas=replicas,
        queued_prompt_tokens=int(sum(_values(members, "queued_prompt_tokens"))),
        tokens_per_s=sum(rates) / len(rates) if rates else 0.0,
        ttft_p99_s=_worst(_values(members, "ttft_p99_s")),
    )


def decode_snapshot(replicas: int, members: list[AutoscalingContext]) -> DecodeSnapshot:
    """KV usage averaged over replicas, running sequences summed, the worst p99 ITL."""
    usage = _values(members, "kv_usage")
    return DecodeSnapshot(
        replicas=replicas,
        kv_usage=sum(usage) / len(usage) if usage else 0.0,
        running=int(sum(_values(members, "running"))),
        itl_p99_s=_worst(_values(members, "itl_p99_s")),
    )
