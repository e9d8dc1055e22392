"""The engine with EPLB on a real gloo group (DP attention + EP, tiny model, float32): with
redundant experts, a placement from an expert-load dump, and rebalancing mid-run every few
group steps, the greedy tokens equal the single-rank engine's on the scripted workload."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from group_scenario import DP_KV_TOKENS, LAYOUTS, SCENARIO_ENGINE, assert_no_leaks, run_scenario

from dsv3serve.engine.llm import LLM
from dsv3serve.eplb.stats import dump
from dsv3serve.parallel.config import ParallelConfig


@pytest.fixture(scope="module")
def reference(scenario_reference: dict[str, list[int]]) -> dict[str, list[int]]:
    return scenario_reference


def skewed_dump(path: Path) -> Path:
    """A recorded-load file: 4 MoE rows (3 layers + NextN) of 16 experts, two hot ones."""
    counts = torch.ones(4, 16, dtype=torch.int64)
    counts[:, 3], counts[:, 11] = 50, 20
    dump(path, counts)
    return path


@pytest.mark.parametrize(
    ("layout", "eplb"),
    [
        ("dp2-ep2", {"ep_num_redundant_experts": 2, "enable_eplb": True}),
        ("dp4-ep4", {"ep_num_redundant_experts": 4, "enable_eplb": True}),
        ("dp2-ep2", {"ep_num_redundant_experts": 4, "init_expert_location": "DUMP"}),
    ],
)
def test_eplb_engine_matches_the_single_rank_engine(
    layout: str, eplb: dict, tiny_bf16_dir: Path, reference: dict, tmp_path: Path
) -> None:
    args = {**SCENARIO_ENGINE, **LAYOUTS[layout], **eplb, "eplb_rebalance_num_iterations": 3}
    if args.get("init_expert_location") == "DUMP":
        args["init_expert_location"] = str(skewed_dump(tmp_path / "load.json"))
    args["num_kv_tokens"] = DP_KV_TOKENS[args["dp_size"]]
    with LLM(str(tiny_bf16_dir), **args) as llm:
        tokens = run_scenario(llm.engine)
        assert_no_leaks(llm.engine)
        runtime = llm.engine.runner.eplb
        assert runtime is not None
        if args.get("enable_eplb"):
            assert runtime.rebalances >= 2, runtime.steps
            assert len(runtime.hot_ratios) == 4 and min(runtime.hot_ratios) >= 1.0
    assert tokens == reference


def test_eplb_flags_refused_without_expert_dispatch() -> None:
    with pytest.raises(ValueError, match="DP attention"):
        ParallelConfig(tp_size=2, ep_size=2, ep_num_redundant_experts=2)
    with pytest.raises(ValueError, match="multiple of"):
        ParallelConfig(
            tp_size=2, dp_size=2, enable_dp_attention=True, ep_size=2, ep_num_redundant_experts=3
        )
