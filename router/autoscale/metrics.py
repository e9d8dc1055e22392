"""Autoscaling metrics on the router's ``/metrics``: the SLO targets (to draw against the
measured ``time_to_first_token_seconds`` / ``inter_token_latency_seconds``), the worker
replicas each role runs now, and joins / leaves the router followed.

The policy's decisions with their reasons are counted where the policy runs, in Serve's
controller (``router.autoscale.serve``), as Ray's metric ``dsv3serve_autoscale_decisions``
(exported by Ray's metrics agent as ``ray_dsv3serve_autoscale_decisions_total``).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

from dsv3serve.metrics import NS, Identity
from router.config import SLO
from router.routing.policy import ReplicaSet


class AutoscaleMetrics:
    """Targets, replicas per role and membership changes of one router replica."""

    def __init__(self, registry: CollectorRegistry, identity: Identity, slo: SLO) -> None:
        labels = [*identity.labels(), "pool"]
        self.identity = identity
        self.replicas = Gauge(
            NS + "autoscale_replicas", "Worker replicas a role runs now.", labels, registry=registry
        )
        self.changes = Counter(
            NS + "autoscale_membership_changes",
            "Worker replicas that joined or left the router's choice.",
            [*labels, "change"],
            registry=registry,
        )
        target = Gauge(
            NS + "slo_target_seconds",
            "The SLO target (p99) the app autoscales for.",
            [*identity.labels(), "slo"],
            registry=registry,
        )
        target.labels(**identity.labels(), slo="ttft_p99").set(slo.ttft_p99_s)
        target.labels(**identity.labels(), slo="itl_p99").set(slo.itl_p99_s)

    def observe(self, pool: str, before: int, replicas: ReplicaSet) -> None:
        """Record ``pool``'s member count after an update (``before``: the count then)."""
        now = len(replicas.members())
        labels = self.identity.labels() | {"pool": pool}
        self.replicas.labels(**labels).set(now)
        if now != before:
            change = "join" if now > before else "leave"
            self.changes.labels(**labels, change=change).inc(abs(now - before))
