"""SLO autoscaling policies for prefill and decode: pure functions of a metric snapshot.

Prefill is sized so its queued prompt tokens clear within the TTFT target at the measured
prefill throughput; decode by KV pool usage, running sequences and measured ITL. Each
returns a :class:`Decision`: the replica count (inside the role's bounds) and the reason,
for the scaling-decision metric. Nothing here reads clocks, Ray or the network.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

Reason = Literal[
    "queue_over_ttft",  # prefill: queued tokens would not clear within the TTFT target
    "ttft_over_target",  # prefill: measured p99 TTFT above target
    "kv_pressure",  # decode: KV pool usage above the high-water mark
    "itl_over_target",  # decode: measured p99 ITL above target
    "running_over_capacity",  # decode: more running sequences than replicas hold well
    "idle",  # either: load fits fewer replicas with margin
    "steady",  # either: no change
    "no_metrics",  # either: no replica reported yet; keep the count
    "bounds",  # either: the count was outside min_replicas..max_replicas
    "starting",  # either: an up held while the last one's replicas are not running yet
    "bounce_hold",  # either: a down held where the role went down and back up lately
]

Move = tuple[float, int]  # a role's count change: (when, count after)


@dataclass(frozen=True)
class Bounds:
    """A role's replica bounds, ``low <= high``."""

    low: int
    high: int

    def clamp(self, replicas: int) -> int:
        return max(self.low, min(self.high, replicas))


@dataclass(frozen=True)
class Decision:
    """How many replicas a role should run, and why."""

    replicas: int
    reason: Reason


@dataclass(frozen=True)
class PrefillSnapshot:
    """The prefill role's state over Serve's look-back window.

    ``queued_prompt_tokens``: prompt tokens waiting or running in prefill, all replicas;
    ``tokens_per_s``: measured prefill throughput of one busy replica (0: not measured);
    ``ttft_p99_s``: measured p99 time to first token (None: no requests finished)."""

    replicas: int
    queued_prompt_tokens: int
    tokens_per_s: float
    ttft_p99_s: float | None


@dataclass(frozen=True)
class DecodeSnapshot:
    """The decode role's state over Serve's look-back window.

    ``kv_usage``: used / total KV pages, mean over replicas (0..1); ``running``: running
    sequences, all replicas; ``itl_p99_s``: measured p99 inter-token latency."""

    replicas: int
    kv_usage: float
    running: int
    itl_p99_s: float | None


@dataclass(frozen=True)
class PolicyKnobs:
    """Margins shared by both policies (defaults suit most deployments).

    ``queue_share``: the part of the TTFT target the queue may take (the rest is the
    handoff and the first decode step); ``down_margin``: scale down only when the
    measured latency is below this share of its target and the load fits one replica
    fewer; ``kv_high`` / ``kv_low``: decode KV usage marks; ``running_per_replica``:
    sequences one decode replica runs within its ITL target."""

    queue_share: float = 0.5
    down_margin: float = 0.5
    kv_high: float = 0.8
    kv_low: float = 0.4
    running_per_replica: int = 32


def prefill_decision(
    snap: PrefillSnapshot, ttft_target_s: float, bounds: Bounds, knobs: PolicyKnobs
) -> Decision:
    """Prefill replicas to meet ``ttft_target_s``: enough to clear the queue in time;
    one more while the measured TTFT misses; one fewer once both fit with margin."""
    if snap.replicas < 1:
        return Decision(bounds.clamp(snap.replicas), "no_metrics")
    need = _replicas_for_queue(snap, ttft_target_s * knobs.queue_share)
    missed = snap.ttft_p99_s is not None and snap.ttft_p99_s > ttft_target_s
    if need > snap.replicas:
        return _decided(need, "queue_over_ttft", snap.replicas, bounds)
    if missed:
        return _decided(snap.replicas + 1, "ttft_over_target", snap.replicas, bounds)
    calm = snap.ttft_p99_s is None or snap.ttft_p99_s < ttft_target_s * knobs.down_margin
    fits = _replicas_for_queue(snap, ttft_target_s * knobs.queue_share * knobs.down_margin)
    if calm and fits < snap.replicas:
        return _decided(snap.replicas - 1, "idle", snap.replicas, bounds)
    return _decided(snap.replicas, "steady", snap.replicas, bounds)


def decode_decision(
    snap: DecodeSnapshot, itl_target_s: float, bounds: Bounds, knobs: PolicyKnobs
) -> Decision:
    """Decode replicas to meet ``itl_target_s``: one more under KV pressure, a missed ITL
    or too many running sequences; one fewer when all three have margin."""
    if snap.replicas < 1:
        return Decision(bounds.clamp(snap.replicas), "no_metrics")
    capacity = knobs.running_per_replica * snap.replicas
    up: Reason | None = None
    if snap.kv_usage > knobs.kv_high:
        up = "kv_pressure"
    elif snap.itl_p99_s is not None and snap.itl_p99_s > itl_target_s:
        up = "itl_over_target"
    elif snap.running > capacity:
        up = "running_over_capacity"
    if up is not None:
        return _decided(snap.replicas + 1, up, snap.replicas, bounds)
    fewer = snap.replicas - 1
    calm = snap.itl_p99_s is None or snap.itl_p99_s < itl_target_s * knobs.down_margin
    kv_fits = snap.kv_usage * snap.replicas < knobs.kv_low * fewer
    running_fits = snap.running <= knobs.running_per_replica * fewer * knobs.down_margin
    if fewer >= 1 and calm and kv_fits and running_fits:
        return _decided(fewer, "idle", snap.replicas, bounds)
    return _decided(snap.replicas, "steady", snap.replicas, bounds)


def settled(
    decision: Decision,
    current: int,
    starting: bool,
    moves: Sequence[Move],
    now: float,
    hold_s: float,
) -> Decision:
    """``decision`` with hysteresis: no further up while replicas of the last up are
    ``starting`` (the metrics still describe the load without them); no down from
    ``current`` when, within ``hold_s`` before ``now``, the role went below ``current``
    and came back up to it (the load needs ``current``: going down again would bounce)."""
    if decision.replicas > current and starting:
        return Decision(current, "starting")
    if decision.replicas < current and _bounced(moves, current, now - hold_s):
        return Decision(current, "bounce_hold")
    return decision


def _bounced(moves: Sequence[Move], count: int, since: float) -> bool:
    """Whether the counts in ``moves`` after ``since`` went below ``count``, then back."""
    below = False
    for when, after in moves:
        if when < since:
            continue
        if after < count:
            below = True
        elif below:
            return True
    return False


def _replicas_for_queue(snap: PrefillSnapshot, budget_s: float) -> int:
    """Replicas whose measured throughput clears the queue within ``budget_s``; with an
    empty queue one; without a throughput measurement the current count."""
    if snap.queued_prompt_tokens == 0:
        return 1
    if snap.tokens_per_s <= 0:
        return snap.replicas
    return max(1, math.ceil(snap.queued_prompt_tokens / (snap.tokens_per_s * budget_s)))


def _decided(want: int, reason: Reason, current: int, bounds: Bounds) -> Decision:
    """``want`` clamped to ``bounds``; a move the bounds cancel is reported as steady."""
    replicas = bounds.clamp(want)
    if replicas != want and replicas != current:
        return Decision(replicas, "bounds")
    if replicas == current and reason not in ("steady", "no_metrics"):
        return Decision(replicas, "steady")
    return Decision(replicas, reason)
