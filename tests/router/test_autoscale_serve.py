"""PDAutoscaler (router/autoscale/serve.py) under Serve's own AutoscalingContext: it
groups the per-replica worker deployments by role, builds each role's snapshot from the
workers' custom metrics and turns the role's decision into 0/1 per deployment; a
deployment it stops leaves the routers first (router/autoscale/leaving.py); a role does
not bounce under steady load. The board the routers read is a recording fake here (the
real one runs in tests/e2e/test_autoscale_app.py)."""

from __future__ import annotations

from collections.abc import Set

import pytest
from ray.serve._private.common import DeploymentID, ReplicaID
from ray.serve.config import AutoscalingContext

from router.autoscale.serve import PDAutoscaler

APP = "dsv3serve"


class BoardFake:
    """Records what the policy publishes as leaving, and answers for the routers'
    acknowledgements: every router has applied every version unless ``lagging`` (the
    real board is a Ray actor)."""

    def __init__(self) -> None:
        self.leaving: set[str] = set()
        self.version = 0
        self.lagging = False

    def publish(self, leaving: Set[str]) -> None:
        self.version += set(leaving) != self.leaving
        self.leaving = set(leaving)

    def acked(self, readers: Set[str]) -> int:
        return 0 if self.lagging else self.version


def context(
    name: str,
    replicas: int,
    metrics: dict[str, float],
    target: int | None = None,
    ongoing: float = 0.0,
) -> AutoscalingContext:
    """A deployment's context with one running replica reporting ``metrics`` (none if
    ``replicas`` is 0); Serve's target defaults to ``replicas``; ``ongoing``: requests
    Serve counts on it."""
    dep = DeploymentID(name=name, app_name=APP)
    running = [ReplicaID(unique_id=f"{name}-r", deployment_id=dep)] if replicas else []
    aggregated = {key: {running[0]: value} for key, value in metrics.items()} if running else {}
    return AutoscalingContext(
        deployment_id=dep,
        deployment_name=name,
        app_name=APP,
        current_num_replicas=replicas,
        target_num_replicas=replicas if target is None else target,
        running_replicas=running,
        total_num_requests=ongoing,
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


def policy(**kwargs: float) -> PDAutoscaler:
    scaler = PDAutoscaler(2.0, 0.1, {"prefill": [1, 3], "decode": [1, 2]}, **kwargs)
    scaler.publisher = BoardFake()
    return scaler


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
    scaler = policy()
    targets, states = scaler({c.deployment_id: c for c in contexts})
    # prefill-1 leaves: routers are told now, Serve stops it once they let go
    assert by_name(targets) == {"prefill-0": 1, "prefill-1": 1, "decode-0": 1, "decode-1": 1}
    assert scaler.publisher.leaving == {"prefill-1"}  # type: ignore[union-attr]
    assert states[DeploymentID(name="decode-1", app_name=APP)]["reason"] == "kv_pressure"
    assert states[DeploymentID(name="prefill-1", app_name=APP)]["reason"] == "idle"


def test_a_role_in_its_cooldown_keeps_its_count() -> None:
    """Serve calls the policy every tick: within ``cooldown_s`` of the policy's start (or
    of the role's last change) a decision to change is held as steady."""
    held = policy(cooldown_s=1e6)
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
    scaler.publisher = BoardFake()

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


CALM_DECODE = {"kv_usage": 0.05, "running": 1, "itl_p99_s": 0.01}


def decode_tick(
    scaler: PDAutoscaler, decode_1: AutoscalingContext, load: dict[str, float] = CALM_DECODE
) -> int:
    """One policy tick over prefill-0, decode-0 and ``decode_1``: decode-1's target."""
    contexts = [context("prefill-0", 1, {"queued_prompt_tokens": 0}), context("decode-0", 1, load)]
    contexts.append(decode_1)
    return by_name(scaler({c.deployment_id: c for c in contexts})[0])["decode-1"]


def test_a_stopped_deployment_leaves_the_routers_before_serve_stops_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The race of issue 33: Serve stopped decode-1 the moment the policy said 0, before
    the routers' next status read, and a request sent in between made Serve start it
    again. Now decode-1 is published leaving while Serve keeps it at 1; Serve gets 0 only
    once every router acknowledged that leaving set, leave_delay_s passed and Serve counts
    no request on decode-1 (its streams ended)."""
    now = [100.0]
    monkeypatch.setattr("router.autoscale.serve.time.monotonic", lambda: now[0])
    scaler = policy(leave_delay_s=3.0, drain_timeout_s=60.0)
    board = scaler.publisher
    assert isinstance(board, BoardFake)
    board.lagging = True
    assert decode_tick(scaler, context("decode-1", 1, CALM_DECODE)) == 1  # idle: 2 -> 1
    assert board.leaving == {"decode-1"} and scaler.decided["decode"] == 1
    now[0] = 101.0  # within the delay
    assert decode_tick(scaler, context("decode-1", 1, CALM_DECODE)) == 1
    now[0] = 104.0  # quiet and past the delay, but a router has not applied the set
    assert decode_tick(scaler, context("decode-1", 1, CALM_DECODE)) == 1
    board.lagging = False  # every router follows it now, but a stream still runs on it
    assert decode_tick(scaler, context("decode-1", 1, CALM_DECODE, ongoing=0.4)) == 1
    now[0] = 105.0  # quiet: Serve may stop it; routers still hold it out
    assert decode_tick(scaler, context("decode-1", 1, CALM_DECODE)) == 0
    assert board.leaving == {"decode-1"}
    now[0] = 106.0  # Serve stopped it: it is out by Serve's own status now
    assert decode_tick(scaler, context("decode-1", 0, {}, target=0)) == 0
    assert board.leaving == set()


def test_a_busy_leaving_deployment_stops_at_drain_timeout_and_a_leave_can_be_called_off(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A leaving deployment whose requests never end gets its 0 at drain_timeout_s (Serve's
    graceful stop then waits for them); load that returns while one leaves keeps it."""
    now = [100.0]
    monkeypatch.setattr("router.autoscale.serve.time.monotonic", lambda: now[0])
    scaler = policy(leave_delay_s=3.0, drain_timeout_s=60.0)
    busy = context("decode-1", 1, CALM_DECODE, ongoing=2.0)
    assert decode_tick(scaler, busy) == 1
    now[0] = 159.0
    assert decode_tick(scaler, busy) == 1
    now[0] = 160.0
    assert decode_tick(scaler, busy) == 0

    back = policy(leave_delay_s=3.0, drain_timeout_s=60.0)
    now[0] = 200.0
    assert decode_tick(back, context("decode-1", 1, CALM_DECODE)) == 1
    assert back.publisher.leaving == {"decode-1"}  # type: ignore[union-attr]
    now[0] = 201.0  # KV pressure on decode-0: decode-1 stays, and rejoins the routers
    assert decode_tick(back, context("decode-1", 1, CALM_DECODE), {"kv_usage": 0.95}) == 1
    assert back.publisher.leaving == set()  # type: ignore[union-attr]


def test_steady_load_bounces_a_role_at_most_once_per_hold(monkeypatch: pytest.MonkeyPatch) -> None:
    """Steady prefill load that one replica cannot hold (its queue misses the TTFT) and two
    hold with an empty queue: 1 -> 2 (queue), 2 -> 1 (idle: the queue is empty at 2), 1 ->
    2 again; from then the policy keeps 2 (a down there would bounce again) for the hold
    of 10 cooldowns. Serve is simulated: a target is running on the next tick."""
    now = [100.0]
    monkeypatch.setattr("router.autoscale.serve.time.monotonic", lambda: now[0])
    scaler = PDAutoscaler(
        2.0, 0.1, {"prefill": [1, 2], "decode": [1, 1]}, cooldown_s=1.0, leave_delay_s=0.5
    )
    scaler.publisher = BoardFake()
    running = {"prefill-0": 1, "prefill-1": 0, "decode-0": 1}
    counts = [1]
    for _ in range(9):  # 9.9 s: the hold lasts 10 s from the bounce's down (t = 2.2 s)
        now[0] += 1.1
        prefill = sum(running[n] for n in ("prefill-0", "prefill-1"))
        load = (
            {"queued_prompt_tokens": 3000, "prefill_tokens_per_s": 1000.0, "ttft_p99_s": 2.5}
            if prefill == 1
            else {"queued_prompt_tokens": 0, "prefill_tokens_per_s": 1000.0, "ttft_p99_s": 0.3}
        )
        contexts = [
            context(n, r, load if n.startswith("prefill") else {}) for n, r in running.items()
        ]
        running = by_name(scaler({c.deployment_id: c for c in contexts})[0])
        if scaler.decided["prefill"] != counts[-1]:
            counts.append(scaler.decided["prefill"])
    assert counts == [1, 2, 1, 2]
