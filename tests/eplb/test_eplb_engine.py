"""The engine with EPLB on a real gloo group (DP attention + EP, tiny model, float32): with
redundant experts, a placement from an expert-load dump, and rebalancing mid-run every few
group steps, the greedy tokens equal the single-rank engine's on the scripted workload.

Each rebalance is recorded on rank 0 (the group's counts it read, the placement before and
after) and checked against the counts themselves: a hottest expert of each layer holds the
most copies, the new placement's busiest rank carries at most the mean rank load plus one
replica's share (a replica takes its expert's load over the replica count), the first
rebalance lowers the busiest ranks' load, and the hot-expert ratio is the last window's max
over mean."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from group_scenario import DP_KV_TOKENS, LAYOUTS, SCENARIO_ENGINE, assert_no_leaks, run_scenario

from dsv3serve.engine.eplb_runtime import EplbRuntime
from dsv3serve.engine.llm import LLM
from dsv3serve.eplb.placement import Placement
from dsv3serve.eplb.stats import dump
from dsv3serve.parallel.config import ParallelConfig


@pytest.fixture(scope="module")
def reference(scenario_reference: dict[str, list[int]]) -> dict[str, list[int]]:
    return scenario_reference


def skewed_counts() -> torch.Tensor:
    """4 MoE rows (3 layers + NextN) of 16 experts, two hot ones."""
    counts = torch.ones(4, 16, dtype=torch.int64)
    counts[:, 3], counts[:, 11] = 50, 20
    return counts


def skewed_dump(path: Path) -> Path:
    """A recorded-load file of :func:`skewed_counts`."""
    dump(path, skewed_counts())
    return path


@dataclass
class Rebalance:
    counts: torch.Tensor  # [L, E] the group's tokens per logical expert in the window
    before: Placement
    after: Placement | None = None


def record_rebalances(runtime: EplbRuntime) -> list[Rebalance]:
    """Every rebalance of ``runtime`` from now on, appended as it happens."""
    seen: list[Rebalance] = []
    read, rebalance = runtime.global_counts, runtime.rebalance_now

    def reading() -> torch.Tensor:
        counts = read()
        seen.append(Rebalance(counts.clone(), runtime.state.expert_map.placement))
        return counts

    def rebalancing(model: object) -> None:
        rebalance(model)  # type: ignore[arg-type]
        seen[-1].after = runtime.state.expert_map.placement

    runtime.global_counts = reading  # type: ignore[method-assign]
    runtime.rebalance_now = rebalancing  # type: ignore[method-assign]
    return seen


def rank_loads(counts: torch.Tensor, placement: Placement, ep: int) -> torch.Tensor:
    """[L, ep]: each rank's tokens, a replica taking its expert's count over its copies."""
    share = counts.double() / placement.logcnt.double()
    return share.gather(1, placement.phy2log).view(len(counts), ep, -1).sum(-1)


def check_rebalances(seen: list[Rebalance], ep: int, hot_ratios: list[float]) -> None:
    busiest: list[torch.Tensor] = []  # [L] per rebalance, under the placement it made
    for r in seen:
        assert r.after is not None
        busiest.append(rank_loads(r.counts, r.after, ep).max(-1).values)
        largest_share = (r.counts.double() / r.after.logcnt).max(-1).values
        bound = r.counts.double().sum(-1) / ep + largest_share
        assert bool((busiest[-1] <= bound + 1e-9).all()), (r.counts, busiest[-1], bound)
        hottest = r.counts == r.counts.max(-1, keepdim=True).values
        most_copies = torch.where(hottest, r.after.logcnt, 0).max(-1).values
        assert torch.equal(most_copies, r.after.logcnt.max(-1).values), (r.counts, r.after)
    first = seen[0]
    replaced = rank_loads(first.counts, first.before, ep).max(-1).values
    assert busiest[0].sum() < replaced.sum(), (first.counts, replaced, busiest[0])
    last = seen[-1].counts.double()
    peak, mean = last.max(-1).values, last.mean(-1)
    expected = torch.where(mean > 0, peak / mean.clamp_min(1e-12), 1.0)  # empty layer: 1
    assert hot_ratios == pytest.approx(expected.tolist())


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
        runtime = llm.engine.runner.eplb
        assert runtime is not None
        seen = record_rebalances(runtime)
        tokens = run_scenario(llm.engine)
        assert_no_leaks(llm.engine)
        if args.get("enable_eplb"):
            assert runtime.rebalances >= 2 and len(seen) == runtime.rebalances, runtime.steps
            assert len(runtime.hot_ratios) == 4
            check_rebalances(seen, args["ep_size"], runtime.hot_ratios)
        else:
            check_dump_placement(runtime.state.expert_map.placement)
    assert tokens == reference


def check_dump_placement(placement: Placement) -> None:
    """The skewed dump's placement on 20 slots over 2 ranks: the 4 redundant slots go to
    the expert with the highest load per copy each time (3: 50 -> 25 -> 16.7, then 11: 20
    -> 10, then 3 again: 12.5), and the ranks carry 84 / 2 = 42 each."""
    logcnt = torch.ones(4, 16, dtype=torch.int64)
    logcnt[:, 3], logcnt[:, 11] = 4, 2
    assert torch.equal(placement.logcnt, logcnt)
    assert rank_loads(skewed_counts(), placement, 2).tolist() == [[42.0, 42.0]] * 4


def test_eplb_flags_refused_without_expert_dispatch() -> None:
    with pytest.raises(ValueError, match="DP attention"):
        ParallelConfig(tp_size=2, ep_size=2, ep_num_redundant_experts=2)
    with pytest.raises(ValueError, match="multiple of"):
        ParallelConfig(
            tp_size=2, dp_size=2, enable_dp_attention=True, ep_size=2, ep_num_redundant_experts=3
        )
