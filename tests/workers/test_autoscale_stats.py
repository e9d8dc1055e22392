"""The worker's autoscaling inputs (workers/autoscale_stats.py) over a stepped clock."""

from __future__ import annotations

import pytest

from workers.autoscale_stats import AutoscaleStats, Window
from workers.protocol import WorkerLoad


class SteppedClock:
    """A clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_window_drops_samples_older_than_its_span() -> None:
    clock = SteppedClock()
    window = Window(10.0, clock)
    for i in range(100):
        window.add(float(i), 1.0)
    assert window.p99() == 98.0  # nearest rank: the 99th of 100 sorted values
    assert window.rate() == pytest.approx(100 / sum(range(100)))
    clock.now = 10.5
    window.add(0.5, 50.0)
    assert window.p99() == 0.5 and window.rate() == 100.0
    clock.now = 30.0
    assert window.p99() == 0.0 and window.rate() == 0.0


def test_prefill_snapshot_counts_held_tokens_and_finished_prefills_only() -> None:
    stats = AutoscaleStats(10.0, SteppedClock())
    stats.prefill_started(300)
    stats.prefill_started(100)
    stats.prefill_ended(100, 0.5)
    load = WorkerLoad(role="prefill", running=1, waiting=0, free_pages=10, num_pages=10)
    assert stats.snapshot(load) == {
        "queued_prompt_tokens": 300.0,
        "prefill_tokens_per_s": 200.0,
        "ttft_p99_s": 0.5,
    }
    stats.prefill_ended(300, None)  # failed or released: no latency sample
    assert stats.snapshot(load)["queued_prompt_tokens"] == 0.0
    assert stats.snapshot(load)["ttft_p99_s"] == 0.5


def test_decode_snapshot_reports_kv_usage_running_and_itl() -> None:
    stats = AutoscaleStats(10.0, SteppedClock())
    for gap in (0.01, 0.02, 0.2):
        stats.token_gap(gap)
    load = WorkerLoad(role="decode", running=3, waiting=0, free_pages=25, num_pages=100)
    assert stats.snapshot(load) == {"kv_usage": 0.75, "running": 3.0, "itl_p99_s": 0.2}
