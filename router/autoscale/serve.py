"""The SLO policies (router/autoscale/decisions.py) as a Ray Serve application-level autoscaling
policy over the app's per-replica worker deployments (``prefill-0``, ``decode-1``, ...).

Each worker deployment runs 0 or 1 replica; a role's replica count is how many of its
deployments run one. Serve's controller calls :class:`PDAutoscaler` with every
deployment's :class:`AutoscalingContext`; the workers' ``record_autoscaling_stats``
metrics (names in :data:`PREFILL_METRICS` / :data:`DECODE_METRICS`) reach it through
``ctx.aggregated_metrics``. It returns, per worker deployment, 1 for the first N of the
role and 0 for the rest, and keeps the decision's reason in the policy state.

``router/autoscale/app.py`` binds the deployments and names this class in the deploy
config's ``autoscaling_policy``. Serve calls it every control-loop tick; a role's count
changes at most once per ``cooldown_s`` (the policy, not Serve, keeps that time).
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Mapping

from ray.serve._private.common import DeploymentID
from ray.serve.config import AutoscalingContext
from ray.util.metrics import Counter

from router.autoscale.decisions import (
    Bounds,
    Decision,
    DecodeSnapshot,
    PolicyKnobs,
    PrefillSnapshot,
    decode_decision,
    prefill_decision,
)

PREFILL_METRICS = ("queued_prompt_tokens", "prefill_tokens_per_s", "ttft_p99_s")
DECODE_METRICS = ("kv_usage", "running", "itl_p99_s")
_WORKER = re.compile(r"^(prefill|decode)-(\d+)$")

PolicyState = dict[str, str | int]
logger = logging.getLogger("ray.serve")


class PDAutoscaler:
    """Serve app-level policy: ``policy_kwargs`` are the SLO targets and each role's
    ``[min, max]`` replicas, e.g. ``{"ttft_p99_s": 2, "itl_p99_s": 0.1, "bounds":
    {"prefill": [1, 3], "decode": [1, 2]}}``."""

    def __init__(
        self,
        ttft_p99_s: float,
        itl_p99_s: float,
        bounds: Mapping[str, list[int]],
        cooldown_s: float = 0.0,
    ) -> None:
        self.ttft_p99_s = ttft_p99_s
        self.itl_p99_s = itl_p99_s
        self.bounds = {role: Bounds(low, high) for role, (low, high) in bounds.items()}
        self.knobs = PolicyKnobs()
        self.cooldown_s = cooldown_s
        self.started = time.monotonic()  # the first change waits a cooldown too
        self.changed_at: dict[str, float] = {}
        self.current: dict[str, int] = {}  # as Serve reports it
        self.decided: dict[str, int] = {}  # as this policy last set it
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
        for role, members in _by_role(contexts).items():
            decision = self.held(role, self.decide(role, [contexts[d] for d in members]))
            for index, dep in enumerate(members):
                targets[dep] = 1 if index < decision.replicas else 0
                states[dep] = {"reason": decision.reason, "role_replicas": decision.replicas}
        return targets, states

    def held(self, role: str, decision: Decision) -> Decision:
        """``decision``, or the role's last decided count while it is in its cooldown (the
        decided count, not the reported one: Serve may not have applied it yet)."""
        now = time.monotonic()
        last = self.decided.setdefault(role, self.current[role])
        if decision.replicas == last:
            return decision
        if now - self.changed_at.get(role, self.started) < self.cooldown_s:
            return Decision(last, "steady")
        self.changed_at[role] = now
        self.decided[role] = decision.replicas
        direction = "up" if decision.replicas > last else "down"
        tags = {"role": role, "reason": decision.reason, "direction": direction}
        self.decisions.inc(1.0, tags=tags)
        logger.info(f"autoscale {role}: {last} -> {decision.replicas} ({decision.reason})")
        return decision

    def decide(self, role: str, members: list[AutoscalingContext]) -> Decision:
        """The role's decision from its deployments' contexts (in index order)."""
        replicas = sum(min(1, ctx.target_num_replicas) for ctx in members)
        self.current[role] = replicas
        bounds = self.bounds.get(role, Bounds(replicas, replicas))
        if role == "prefill":
            snap = prefill_snapshot(replicas, members)
            return prefill_decision(snap, self.ttft_p99_s, bounds, self.knobs)
        return decode_decision(
            decode_snapshot(replicas, members), self.itl_p99_s, bounds, self.knobs
        )


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
