"""The model bench's report arithmetic: graph rounds, projections to 61 layers, profiles."""

from __future__ import annotations

import statistics
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from dsv3serve.bench.model.mtp import GraphSpecCosts, SpecCosts, speedup_rows
from dsv3serve.bench.model.points import graph_costs
from dsv3serve.bench.model.profile import (
    DeviceOp,
    call_windows,
    device_ops,
    summarize_ops,
)
from dsv3serve.bench.model.projection import project_full_depth, project_graph_costs
from dsv3serve.bench.model.roofline import (
    expected_experts_hit,
)
from dsv3serve.bench.model.setup import (
    bench_model_config,
)


def test_graph_round_is_chain_plus_eager_extend_plus_verify() -> None:
    """k = 3: the 2 chained steps in one graph (1.5 ms), the eager extend (2 ms), the
    graphed verify (4 ms), against a graphed decode step of 2.5 ms."""
    costs = GraphSpecCosts(2.5, 2.0, {1: 3.0, 3: 4.0}, {3: 1.5})
    assert costs.round_ms(3) == 7.5 and costs.round_ms(1) == 5.0  # k = 1: no chain
    assert costs.break_even(3) == 3.0
    assert costs.speedup(3, 4.0) == pytest.approx(4.0 * 2.5 / 7.5)
    rows = graph_costs(
        [
            {"batch_size": 8, "draft_ms": 2.0, "graph": None},
            {"batch_size": 1, "draft_ms": 2.0, "graph": {"decode_ms": 2.5,
             "verify_ms": {"1": 3.0, "3": 4.0}, "chain_ms": {"3": 1.5}}},
        ]
    )  # fmt: skip
    assert rows == {1: costs}


def test_graph_round_uses_the_graphed_extend_where_measured() -> None:
    """k = 3: chain 1.5 ms + graphed extend 0.8 ms + verify 4 ms; k = 1 has no graphed
    extend measured, so the eager draft step (2 ms) stands for it; the 61-layer round
    keeps the measured (one-layer) extend."""
    graph = {"decode_ms": 2.5, "verify_ms": {"1": 3.0, "3": 4.0}, "chain_ms": {"3": 1.5},
             "extend_ms": {"3": 0.8}}  # fmt: skip
    full = {"decode_ms": 20.0, "verify_ms": {"1": 30.0, "3": 40.0}}
    rows = [{"batch_size": 1, "draft_ms": 2.0, "graph": {**graph, "projected_61": full}}]
    costs = graph_costs(rows)[1]
    assert costs.round_ms(3) == pytest.approx(1.5 + 0.8 + 4.0)
    assert costs.round_ms(1) == pytest.approx(2.0 + 3.0)
    full_costs = graph_costs(rows, projected=True)[1]
    assert full_costs.round_ms(3) == pytest.approx(1.5 + 0.8 + 40.0)
    assert full_costs.break_even(3) == pytest.approx(42.3 / 20.0)


def test_graphed_steps_projected_to_61_layers() -> None:
    """1 dense + 2 MoE layers measured: 61 layers add 2 dense and 56 MoE layers, each at
    the graphed single-layer time of the step's width (1 token decode, k + 1 verify)."""
    cfg = bench_model_config("tiny", 2, mtp=True)
    layer_ms = {"dense": {"1": 0.1, "2": 0.2, "4": 0.4}, "moe": {"1": 0.3, "2": 0.5, "4": 0.7}}
    graph = {"decode_ms": 2.0, "verify_ms": {"1": 3.0, "3": 4.0}, "chain_ms": {"3": 1.5}}
    full = project_graph_costs(graph, layer_ms, cfg)
    assert full["decode_ms"] == pytest.approx(2.0 + 56 * 0.3 + 2 * 0.1)  # 19.0
    assert full["verify_ms"]["1"] == pytest.approx(3.0 + 56 * 0.5 + 2 * 0.2)  # 31.4
    assert full["verify_ms"]["3"] == pytest.approx(4.0 + 56 * 0.7 + 2 * 0.4)  # 44.0
    rows = [
        {"batch_size": 4, "draft_ms": 1.0, "graph": {**graph, "projected_61": full}},
        {"batch_size": 8, "draft_ms": 1.0, "graph": {**graph, "projected_61": None}},
    ]
    (costs,) = graph_costs(rows, projected=True).values()
    assert costs.round_ms(3) == pytest.approx(1.5 + 1.0 + 44.0)  # chain + extend + verify_61
    assert costs.round_ms(1) == pytest.approx(1.0 + 31.4)
    assert costs.break_even(3) == pytest.approx(46.5 / 19.0)
    assert graph_costs(rows)[8].decode_ms == 2.0  # the measured table keeps every row


def test_kernel_profile_summary() -> None:
    """Two profiled calls: 'gemm' 3 x 100 us, 'norm' 2 x 10 us, 'argmax' 1 x 30 us."""
    ops = [
        DeviceOp("gemm", 0.0, 100.0), DeviceOp("norm", 105.0, 115.0),
        DeviceOp("gemm", 120.0, 220.0), DeviceOp("argmax", 1000.0, 1030.0),
        DeviceOp("gemm", 1040.0, 1140.0), DeviceOp("norm", 1150.0, 1160.0),
    ]  # fmt: skip
    s = summarize_ops(ops, [(-5.0, 300.0), (990.0, 1200.0)], calls=2, top=2)
    assert s["kernel_ms"] == pytest.approx(0.350 / 2)
    assert s["ops_per_call"] == 3.0
    assert s["span_ms"] == pytest.approx(statistics.median([0.220, 0.160]))
    assert [op["name"] for op in s["top"]] == ["gemm", "argmax"]
    gemm = s["top"][0]
    assert (gemm["per_call"], gemm["ms"]) == (1.5, pytest.approx(0.150))
    assert gemm["share"] == pytest.approx(300 / 350)


def _event(name: str, device: str, start: float, end: float, note: bool = False) -> Any:
    """A stand-in for a ``torch.profiler`` FunctionEvent (the fields the summary reads)."""
    kind = getattr(torch.autograd.DeviceType, device)
    span = SimpleNamespace(start=start, end=end)
    return SimpleNamespace(name=name, device_type=kind, time_range=span, is_user_annotation=note)


def test_profile_events_split_into_device_ops_and_call_windows() -> None:
    events = [
        _event("bench_call0", "CPU", 0.0, 500.0, note=True),
        _event("bench_call0", "CUDA", 40.0, 450.0, note=True),  # Kineto's device mirror
        _event("cudaGraphLaunch", "CPU", 30.0, 45.0),
        _event("gemm_kernel", "CUDA", 50.0, 150.0),
        _event("Memcpy DtoD", "CUDA", 160.0, 165.0),
        _event("bench_call1", "CPU", 600.0, 900.0, note=True),
    ]
    assert device_ops(events) == [
        DeviceOp("gemm_kernel", 50.0, 150.0), DeviceOp("Memcpy DtoD", 160.0, 165.0)
    ]  # fmt: skip
    assert call_windows(events) == [(0.0, 500.0), (600.0, 900.0)]


def test_speedup_arithmetic() -> None:
    costs = SpecCosts(decode_ms=10.0, draft_ms=2.0, verify_ms={1: 12.0, 3: 14.0})
    assert costs.round_ms(3) == 20.0
    assert costs.break_even(3) == 2.0
    assert costs.speedup(3, 3.0) == pytest.approx(1.5)
    assert costs.speedup(1, 2.5) is None  # one draft step commits at most 2 tokens
    (row1, row3) = speedup_rows({8: costs}, (1.0, 2.0))
    assert (row1["num_steps"], row1["round_ms"], row1["speedup"]["2.0"]) == (1, 14.0, 20 / 14)


def test_expected_experts_hit() -> None:
    assert expected_experts_hit(256, 8, 1) == pytest.approx(8.0)
    assert expected_experts_hit(256, 8, 0) == 0.0
    assert 255.0 < expected_experts_hit(256, 8, 512) <= 256.0
    assert expected_experts_hit(256, 8, 32) == pytest.approx(256 * (1 - (1 - 8 / 256) ** 32))


def test_projection_to_61_layers() -> None:
    cfg = bench_model_config("tiny", 2, mtp=False)  # layer0 dense, layers 1-2 MoE
    parts = {"embed": 1.0, "layer0": 4.0, "layer1": 10.0, "layer2": 12.0, "head": 2.0}
    assert project_full_depth(parts, cfg) == pytest.approx(3.0 + 3 * 4.0 + 58 * 11.0)
    with pytest.raises(ValueError, match="expected dense and MoE layers"):
        project_full_depth({"layer0": 1.0}, cfg)
