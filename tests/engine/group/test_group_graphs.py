"""The CUDA-graph decode path in groups, run uncaptured on CPU (``DSV3SERVE_EAGER_GRAPH_PATH``),
gives the single-rank engine's greedy tokens.

On a GPU every rank captures a graph per batch size and replays the one of the size the group
agreed on; here the same padded, static-buffer path runs eagerly over gloo: under TP every
rank pads the same batch; under DP attention the leader picks one size from every rank's
batch, a rank with fewer sequences pads with dummy rows and a rank with none runs dummies
only, and the MoE goes through the all-gather dispatcher's uniform path. The reference is
the plain one-rank engine (no graph path) on the same checkpoint.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from group_scenario import DP_KV_TOKENS, LAYOUTS, SCENARIO_ENGINE, assert_no_leaks, run_scenario

from dsv3serve.engine.group import dp as dp_group
from dsv3serve.engine.llm import LLM
from dsv3serve.engine.model_runner import EAGER_GRAPH_PATH_ENV

GRAPH_LAYOUTS = ["tp2-ep2", "dp2-ep2", "dp2-ep2-dp-lm-head"]


@pytest.fixture(scope="module")
def reference(scenario_reference: dict[str, list[int]]) -> dict[str, list[int]]:
    return scenario_reference


@pytest.mark.parametrize("layout", GRAPH_LAYOUTS)
def test_graph_path_in_a_group_matches_the_single_rank_engine(
    layout: str,
    tiny_bf16_dir: Path,
    reference: dict[str, list[int]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(EAGER_GRAPH_PATH_ENV, "1")  # the spawned ranks inherit it
    shapes: list[tuple[list[int], dp_group.StepShape]] = []
    choose = dp_group.step_shape

    def recording(parts: list, graphs: object) -> dp_group.StepShape:
        shape = choose(parts, graphs)  # type: ignore[arg-type]
        shapes.append(([len(p) for p in parts], shape))
        return shape

    monkeypatch.setattr(dp_group, "step_shape", recording)
    args = {**SCENARIO_ENGINE, **LAYOUTS[layout]}
    if args.get("enable_dp_attention"):
        args["num_kv_tokens"] = DP_KV_TOKENS[args["dp_size"]]
    with LLM(str(tiny_bf16_dir), **args) as llm:
        graphs = llm.engine.runner.graphs
        assert graphs is not None
        tokens = run_scenario(llm.engine)
        assert_no_leaks(llm.engine)
        assert graphs.steps > 0, "no decode step took the graph path"
    assert tokens == reference
    if args.get("enable_dp_attention"):
        graphed = [(lens, s.graph_size) for lens, s in shapes if s.graph_size]
        assert any(0 in lens for lens, _ in graphed), "no rank replayed dummies only"
        assert any(len(set(lens)) > 1 for lens, _ in graphed), "ranks never padded unequally"
        assert all(s.graph_size == 0 for _, s in shapes if not s.decode)


def test_graph_path_with_the_overlap_scheduler_under_dp_attention(
    tiny_bf16_dir: Path, reference: dict[str, list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Placeholder tokens of the overlap scheduler resolve inside the padded graph path on
    every rank. The request aborted mid-generation emits one step fewer under overlap (its
    emission lags a step), so it is left out of the comparison."""
    monkeypatch.setenv(EAGER_GRAPH_PATH_ENV, "1")
    args = {**SCENARIO_ENGINE, **LAYOUTS["dp2-ep2"], "force_overlap_schedule": True}
    args["num_kv_tokens"] = DP_KV_TOKENS[2]
    with LLM(str(tiny_bf16_dir), **args) as llm:
        assert llm.engine.overlap and llm.engine.runner.graphs is not None
        tokens = run_scenario(llm.engine)
        assert_no_leaks(llm.engine)
        assert llm.engine.runner.graphs.steps > 0
    del tokens["aborted"]
    assert tokens == {k: v for k, v in reference.items() if k != "aborted"}
