"""The dispatch meter on a GPU: CUDA events and device row counts read lazily, no host sync
while recording (``torch.cuda.set_sync_debug_mode("error")`` raises on one), nothing
recorded while a graph is captured. One GPU; skipped without one.

Passed on one H200 on 2026-11-29 (docs/deepep.md).
"""

from __future__ import annotations

import pytest
import torch

from dsv3serve.parallel.dispatch_meter import DispatchMeter

pytestmark = pytest.mark.gpu


def _step(meter: DispatchMeter, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    mark = meter.start(x)
    y = x @ x  # stands in for the exchange
    meter.stop(mark, "dispatch", "low_latency", counts, 100)
    return y


def test_records_without_a_host_sync_and_reads_later() -> None:
    meter = DispatchMeter(rank=0)
    x = torch.randn(1024, 1024, device="cuda")
    counts = torch.tensor([3, 0, 2], dtype=torch.int32, device="cuda")
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            _step(meter, x, counts)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    (phase,) = meter.snapshot()["phases"]
    assert (phase["bytes"], phase["count"]) == (3 * 500, 3)
    assert phase["seconds"] > 0


def test_nothing_is_recorded_while_a_graph_is_captured() -> None:
    meter = DispatchMeter(rank=0)
    x = torch.randn(256, 256, device="cuda")
    counts = torch.ones(4, dtype=torch.int32, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        _step(meter, x, counts)  # warm-up outside the graph: recorded
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = _step(meter, x, counts)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(y, x @ x)
    (phase,) = meter.snapshot()["phases"]
    assert phase["count"] == 1 and phase["bytes"] == 400


def test_a_pair_shares_one_count_copy_and_an_off_meter_records_nothing() -> None:
    """The combine meters the count its dispatch copied (one sum, one pinned copy per pair);
    a meter made off records no event and touches no count."""
    meter, off = DispatchMeter(rank=0), DispatchMeter(rank=0, enabled=False)
    x = torch.randn(256, 256, device="cuda")
    counts = torch.tensor([3, 0, 2], dtype=torch.int32, device="cuda")
    torch.cuda.set_sync_debug_mode("error")
    try:
        counted = meter.stop(meter.start(x), "dispatch", "low_latency", counts, 100)
        assert counted is not None
        meter.stop(meter.start(x), "combine", "low_latency", counted, 10)
        assert off.start(x) is None
        assert off.stop(None, "dispatch", "low_latency", counts, 100) is None
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    got = {p["phase"]: p["bytes"] for p in meter.snapshot()["phases"]}
    assert got == {"dispatch": 500, "combine": 50}
    assert off.snapshot()["phases"] == []
