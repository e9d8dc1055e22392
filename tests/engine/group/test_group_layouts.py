"""Sharded groups over real processes (gloo) give the single-rank engine's greedy tokens.

Each layout runs the same scripted workload (chunked prefill, prefix hits, preemption, an
abort) on the tiny checkpoint with 16 experts in float32: rank 0 is this test process, the
other ranks are spawned processes holding only their shard. The reference is the plain
one-rank engine on the same checkpoint.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from group_scenario import (
    DP_KV_TOKENS,
    LAYOUTS,
    SCENARIO_ENGINE,
    assert_no_leaks,
    run_scenario,
)

from dsv3serve.engine.config import EngineConfig
from dsv3serve.engine.engine import Engine
from dsv3serve.engine.llm import LLM


@pytest.fixture(scope="module")
def reference(scenario_reference: dict[str, list[int]]) -> dict[str, list[int]]:
    return scenario_reference


@pytest.mark.parametrize("layout", LAYOUTS)
def test_layout_matches_the_single_rank_engine(
    layout: str, tiny_bf16_dir: Path, reference: dict[str, list[int]]
) -> None:
    engine_args = {**SCENARIO_ENGINE, **LAYOUTS[layout]}
    if engine_args.get("enable_dp_attention"):
        engine_args["num_kv_tokens"] = DP_KV_TOKENS[engine_args["dp_size"]]
    with LLM(str(tiny_bf16_dir), **engine_args) as llm:
        tokens = run_scenario(llm.engine)
        assert_no_leaks(llm.engine)
        scheduler = llm.engine.scheduler
        assert scheduler.num_preemptions > 0 and scheduler.prefix_hit_tokens > 0
    assert tokens == reference


@pytest.fixture(scope="module")
def overlap_reference(tiny_bf16_dir: Path, reference: dict[str, list[int]]) -> dict[str, list[int]]:
    """The one-rank engine with the overlap scheduler: the same tokens, except that the
    request aborted mid-generation has emitted one step fewer (emission lags a step)."""
    engine = Engine(
        EngineConfig(model=str(tiny_bf16_dir), **SCENARIO_ENGINE, force_overlap_schedule=True)
    )
    assert engine.overlap
    tokens = run_scenario(engine)
    assert_no_leaks(engine)
    assert {k: v for k, v in tokens.items() if k != "aborted"} == {
        k: v for k, v in reference.items() if k != "aborted"
    }
    return tokens


@pytest.mark.parametrize("layout", ["tp2-ep2", "dp2-ep2"])
def test_layout_with_the_overlap_scheduler_matches_the_single_rank_engine(
    layout: str, tiny_bf16_dir: Path, overlap_reference: dict[str, list[int]]
) -> None:
    """Rank 0 launches step n+1 before reading step n's tokens; the followers resolve the
    placeholders from their own rings, which rank 0 fills after each sample."""
    engine_args = {**SCENARIO_ENGINE, **LAYOUTS[layout], "force_overlap_schedule": True}
    if engine_args.get("enable_dp_attention"):
        engine_args["num_kv_tokens"] = DP_KV_TOKENS[engine_args["dp_size"]]
    with LLM(str(tiny_bf16_dir), **engine_args) as llm:
        assert llm.engine.overlap
        tokens = run_scenario(llm.engine)
        assert_no_leaks(llm.engine)
        scheduler = llm.engine.scheduler
        assert scheduler.num_preemptions > 0 and scheduler.prefix_hit_tokens > 0
    assert tokens == overlap_reference
