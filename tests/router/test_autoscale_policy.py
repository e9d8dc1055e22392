"""The SLO autoscaling policies (router/autoscale/decisions.py) on a table of metric snapshots ->
decisions, their hysteresis on a table of recent moves, and the config fields that carry
their targets and bounds (router/config.py)."""

from __future__ import annotations

from typing import Any

import pytest

from router.autoscale.decisions import (
    Bounds,
    Decision,
    DecodeSnapshot,
    PolicyKnobs,
    PrefillSnapshot,
    decode_decision,
    prefill_decision,
    settled,
)
from router.config import SLO, ConfigError, RoleGroup, ServingConfig
from router.launch import local_pd_config

TTFT, ITL = 2.0, 0.1
KNOBS = PolicyKnobs()
B14 = Bounds(1, 4)

# replicas, queued prompt tokens, tokens/s per replica, measured TTFT p99 -> decision
PREFILL_TABLE = [
    # 4000 tokens at 1000 tok/s within 1 s (half the 2 s target): 4 replicas
    ((1, 4000, 1000.0, 0.5), Decision(4, "queue_over_ttft")),
    ((1, 8000, 1000.0, 0.5), Decision(4, "bounds")),  # 8 wanted, max 4
    ((2, 1500, 1000.0, 0.5), Decision(2, "steady")),  # fits 2, not 1 with margin
    ((2, 1000, 1000.0, 3.0), Decision(3, "ttft_over_target")),  # queue fits, TTFT missed
    ((4, 1000, 1000.0, 3.0), Decision(4, "steady")),  # missed, but at max
    ((3, 100, 1000.0, 0.2), Decision(2, "idle")),  # one fewer at a time
    ((3, 100, 1000.0, 1.5), Decision(3, "steady")),  # TTFT under target, not under margin
    ((1, 0, 1000.0, None), Decision(1, "steady")),  # at min
    ((2, 0, 0.0, None), Decision(1, "idle")),  # no throughput yet: queue says nothing
    ((2, 500, 0.0, 2.5), Decision(3, "ttft_over_target")),
    ((0, 0, 0.0, None), Decision(1, "no_metrics")),
    ((6, 0, 1000.0, 0.1), Decision(4, "bounds")),  # above max: back inside
]

# replicas, KV usage, running, measured ITL p99 -> decision
DECODE_TABLE = [
    ((1, 0.9, 10, 0.05), Decision(2, "kv_pressure")),
    ((2, 0.5, 10, 0.2), Decision(3, "itl_over_target")),
    ((1, 0.5, 40, 0.05), Decision(2, "running_over_capacity")),
    ((4, 0.95, 200, 0.5), Decision(4, "steady")),  # every signal high, at max
    ((3, 0.1, 4, 0.02), Decision(2, "idle")),
    ((3, 0.1, 4, 0.08), Decision(3, "steady")),  # ITL not under margin
    ((2, 0.3, 4, 0.02), Decision(2, "steady")),  # 0.6 of one pool: over kv_low
    ((2, 0.1, 40, 0.02), Decision(2, "steady")),  # 40 running > 16 one replica holds well
    ((1, 0.0, 0, None), Decision(1, "steady")),  # at min
    ((0, 0.0, 0, None), Decision(1, "no_metrics")),
]


@pytest.mark.parametrize(("row", "expected"), PREFILL_TABLE)
def test_prefill_policy_table(row: tuple[Any, ...], expected: Decision) -> None:
    snap = PrefillSnapshot(*row)
    assert prefill_decision(snap, TTFT, B14, KNOBS) == expected


@pytest.mark.parametrize(("row", "expected"), DECODE_TABLE)
def test_decode_policy_table(row: tuple[Any, ...], expected: Decision) -> None:
    snap = DecodeSnapshot(*row)
    assert decode_decision(snap, ITL, B14, KNOBS) == expected


# the policy's decision, the role's current count, its replicas still starting, its moves
# (when, count after), now -> what it settles to (hold 100 s)
UP, DOWN, STAY = Decision(3, "queue_over_ttft"), Decision(1, "idle"), Decision(2, "steady")
SETTLE_TABLE = [
    ((UP, 2, False, [], 50.0), UP),
    ((UP, 2, True, [], 50.0), Decision(2, "starting")),  # the last up still starts
    ((DOWN, 2, True, [], 50.0), DOWN),  # starting holds ups only
    ((DOWN, 2, False, [(10.0, 2)], 50.0), DOWN),  # up once: a down may follow
    ((DOWN, 2, False, [(10.0, 2), (20.0, 1), (30.0, 2)], 50.0), Decision(2, "bounce_hold")),
    ((DOWN, 2, False, [(20.0, 1), (30.0, 2)], 119.0), Decision(2, "bounce_hold")),
    ((DOWN, 2, False, [(20.0, 1), (30.0, 2)], 121.0), DOWN),  # the bounce is 100 s old
    ((DOWN, 2, False, [(20.0, 2), (30.0, 3)], 50.0), DOWN),  # went up twice: no bounce
    ((DOWN, 3, False, [(20.0, 1), (30.0, 2)], 50.0), DOWN),  # bounced at 2, not at 3
    ((STAY, 2, True, [(20.0, 1), (30.0, 2)], 50.0), STAY),
]


@pytest.mark.parametrize(("row", "expected"), SETTLE_TABLE)
def test_hysteresis_table(row: tuple[Any, ...], expected: Decision) -> None:
    decision, current, starting, moves, now = row
    assert settled(decision, current, starting, moves, now, hold_s=100.0) == expected


def test_decisions_always_lie_within_bounds() -> None:
    for replicas in range(0, 7):
        for queued in (0, 10, 10_000, 10**7):
            for ttft in (None, 0.1, 10.0):
                snap = PrefillSnapshot(replicas, queued, 500.0, ttft)
                assert 1 <= prefill_decision(snap, TTFT, B14, KNOBS).replicas <= 4
        for usage in (0.0, 0.5, 1.0):
            snap_d = DecodeSnapshot(replicas, usage, 100, 0.5)
            assert 1 <= decode_decision(snap_d, ITL, B14, KNOBS).replicas <= 4


def pd_args(**change: Any) -> dict[str, Any]:
    return {**local_pd_config()["applications"][0]["args"], **change}


def test_role_bounds_default_to_num_replicas_and_are_checked() -> None:
    assert RoleGroup(num_replicas=2).bounds() == (2, 2)
    assert RoleGroup(num_replicas=2, min_replicas=1, max_replicas=3).bounds() == (1, 3)
    with pytest.raises(ValueError, match=r"min_replicas \(3\) <= num_replicas \(2\)"):
        RoleGroup(num_replicas=2, min_replicas=3)
    assert SLO(ttft_p99_s=1.0, itl_p99_s=0.05).itl_p99_s == 0.05
    with pytest.raises(ValueError):
        SLO(ttft_p99_s=0, itl_p99_s=0.05)


def test_varying_bounds_without_slo_and_slo_outside_pd_are_refused() -> None:
    """Varying bounds with no targets to scale by, or slo in colocated mode, would be
    silently run at a fixed size: refused, naming why; PD with slo is accepted."""
    ServingConfig.parse(pd_args())
    slo = {"ttft_p99_s": 1.0, "itl_p99_s": 0.05}
    cfg = ServingConfig.parse(pd_args(slo=slo, decode={"min_replicas": 1, "max_replicas": 2}))
    assert cfg.slo is not None and cfg.decode.bounds() == (1, 2)
    with pytest.raises(ConfigError, match="expected slo set"):
        ServingConfig.parse(pd_args(decode={"min_replicas": 1, "max_replicas": 2}))
    with pytest.raises(ConfigError, match="expected mode pd, found colocated"):
        ServingConfig.parse(pd_args(mode="colocated", slo=slo))
