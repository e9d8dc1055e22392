"""PDAutoscaler (router/autoscale/serve.py) under Serve's own AutoscalingContext: it
groups the per-replica worker deployments by role, builds each role's snapshot from the
workers' custom metrics and turns the role's decision into 0/1 per deployment."""

from __future__ import annotations

import pytest
from ray.serve._private.common import DeploymentID, ReplicaID
from ray.serve.config import AutoscalingContext

from router.autoscale.serve import PDAutoscaler

APP = "dsv3serve"


def context(name: str, replicas: int, metrics: dict[str, float]) -> AutoscalingContext:
    """A deployment's context with one running replica reporting ``metrics`` (none if
    ``replicas`` is 0)."""
    dep = DeploymentID(name=name, app_name=APP)
    running = [ReplicaID(unique_id=f"{name}-r", deployment_id=dep)] if replicas else []
    aggregated = {key: {running[0]: value} for key, value in metrics.items()} if running else {}
    return AutoscalingContext(
        deployment_id=dep,
        deployment_name=name,
        app_name=APP,
        current_num_replicas=replicas,
        target_num_replicas=replicas,
        running_replicas=running,
        total_num_requests=0.0,
        total_queued_requests=0.0,
        aggregated_metrics=aggregated,
        raw_metrics={},
        capacity_adjusted_min_replicas=0,
        capacity_adjusted_max_replicas=1,
        policy_state={},
        last_scale_up_time=None,
        last_scale_down_time=None,
        current_time=0.0,
        config=None,
    )


def policy() -> PDAutoscaler:
    return PDAutoscaler(2.0, 0.1, {"prefill": [1, 3], "decode": [1, 2]})


def by_name(targets: dict[DeploymentID, int]) -> dict[str, int]:
    return {dep.name: n for dep, n in targets.items()}


def test_a_long_queue_brings_up_prefill_deployments_in_index_order() -> None:
    prefill_load = {"queued_prompt_tokens": 2500, "prefill_tokens_per_s": 1000.0}
    contexts = [
        context("prefill-1", 0, {}),
        context("prefill-0", 1, prefill_load),
        context("prefill-2", 0, {}),
        context("decode-0", 1, {"kv_usage": 0.2, "running": 3, "itl_p99_s": 0.08}),
        context("decode-1", 0, {}),
        context("router", 2, {}),
    ]
    targets, states = policy()({c.deployment_id: c for c in contexts})
    assert by_name(targets) == {
        "prefill-0": 1,
        "prefill-1": 1,
        "prefill-2": 1,
        "decode-0": 1,
        "decode-1": 0,
    }  # 2500 tokens at 1000/s in 1 s: 3; decode steady; the router left to Serve
    prefill_state = states[DeploymentID(name="prefill-2", app_name=APP)]
    assert prefill_state == {"reason": "queue_over_ttft", "role_replicas": 3}


def test_kv_pressure_adds_a_decode_and_idle_prefill_gives_one_back() -> None:
    contexts = [
        context("prefill-0", 1, {"queued_prompt_tokens": 0, "ttft_p99_s": 0.1}),
        context("prefill-1", 1, {"queued_prompt_tokens": 0, "ttft_p99_s": 0.2}),
        context("decode-0", 1, {"kv_usage": 0.95, "running": 10, "itl_p99_s": 0.05}),
        context("decode-1", 0, {}),
    ]
    targets, states = policy()({c.deployment_id: c for c in contexts})
    assert by_name(targets) == {"prefill-0": 1, "prefill-1": 0, "decode-0": 1, "decode-1": 1}
    assert states[DeploymentID(name="decode-1", app_name=APP)]["reason"] == "kv_pressure"
    assert states[DeploymentID(name="prefill-1", app_name=APP)]["reason"] == "idle"


def test_a_role_in_its_cooldown_keeps_its_count() -> None:
    """Serve calls the policy every tick: within ``cooldown_s`` of the policy's start (or
    of the role's last change) a decision to change is held as steady."""
    held = PDAutoscaler(2.0, 0.1, {"prefill": [1, 3], "decode": [1, 2]}, cooldown_s=1e6)
    contexts = [
        context("prefill-0", 1, {"queued_prompt_tokens": 2500, "prefill_tokens_per_s": 1000.0}),
        context("prefill-1", 0, {}),
        context("decode-0", 1, {"kv_usage": 0.95, "running": 10, "itl_p99_s": 0.05}),
        context("decode-1", 0, {}),
    ]
    targets, states = held({c.deployment_id: c for c in contexts})
    assert by_name(targets) == {"prefill-0": 1, "prefill-1": 0, "decode-0": 1, "decode-1": 0}
    assert states[DeploymentID(name="decode-1", app_name=APP)]["reason"] == "steady"


def test_a_change_holds_through_its_cooldown_while_serve_still_reports_the_old_count(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Decode goes 1 -> 2 on KV pressure; on the next tick Serve still reports 1 replica
    and the load looks calm: within the cooldown the policy keeps its 2, not the reported
    1 (which would undo its own decision)."""
    now = [0.0]
    monkeypatch.setattr("router.autoscale.serve.time.monotonic", lambda: now[0])
    scaler = PDAutoscaler(2.0, 0.1, {"prefill": [1, 1], "decode": [1, 2]}, cooldown_s=50.0)

    def tick(decode_load: dict[str, float]) -> dict[str, int]:
        contexts = [
            context("prefill-0", 1, {"queued_prompt_tokens": 0}),
            context("decode-0", 1, decode_load),
            context("decode-1", 0, {}),
        ]
        return by_name(scaler({c.deployment_id: c for c in contexts})[0])

    now[0] = 100.0
    assert tick({"kv_usage": 0.95, "running": 10, "itl_p99_s": 0.05})["decode-1"] == 1
    now[0] = 101.0
    assert tick({"kv_usage": 0.1, "running": 1, "itl_p99_s": 0.01})["decode-1"] == 1
