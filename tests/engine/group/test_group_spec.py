"""MTP speculative decoding in TP and DP-attention groups over real processes (gloo) is
lossless.

The group scenario (chunked prefill, prefix hits, preemption, an abort) on the tiny bf16
checkpoint in float32, with the checkpoint's NextN layer drafting 2 tokens a round: rank 0
is this test process, the other rank a spawned process holding only its shard and
running the draft and verify forwards rank 0 broadcasts. References: the plain one-rank
engine without speculation for the tokens (greedy MTP must give them exactly), and the
one-rank speculative engine for the drafts (a follower that ran the draft steps wrong
would change them, while the tokens, being lossless, would not). With a checkpoint whose
NextN layer is an oracle, rounds accept their drafts, so the extend runs over several
committed decode positions too; that draft ignores its hidden input and attention, so
that test checks the accepting rounds' sequence of forwards, not the draft's numbers
(the random NextN draft's drafts do: a follower extending from the wrong rows fails it).

Under DP attention each rank batches its own sequences, so the rounds differ from the one
rank's; the drafts are compared per (sequence, length at proposal) where both ran one, up
to the shorter chain (the lookahead a rank grants depends on its own pool).
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
from spec_util import make_oracle_draft_checkpoint

from dsv3serve.engine.config import EngineConfig
from dsv3serve.engine.engine import Engine
from dsv3serve.engine.llm import LLM
from dsv3serve.engine.model_runner import EAGER_GRAPH_PATH_ENV
from dsv3serve.engine.scheduler.sequence import ScheduledItem

SPEC = {"speculative_algorithm": "NEXTN", "speculative_num_steps": 2}
TP_LAYOUTS = ("tp2", "tp2-ep2")
DP_LAYOUTS = ("dp2-ep2", "dp2-ep2-dp-lm-head")
Drafts = list[dict[str, list[int]]]
ByPosition = dict[tuple[str, int], list[int]]


def record_drafts(engine: Engine) -> Drafts:
    """Every step's proposed drafts (by sequence), appended as the engine runs."""
    rounds: Drafts = []
    propose = engine.spec.propose

    def recording(items: list[ScheduledItem]) -> dict[str, list[int]]:
        drafts = propose(items)
        rounds.append(drafts)
        return drafts

    engine.spec.propose = recording  # type: ignore[method-assign]
    return rounds


def drafts_by_position(engine: Engine, ranks: set[int] | None = None) -> ByPosition:
    """Every proposal, keyed by (sequence, its length when proposed), filled as it runs;
    ``ranks`` collects the DP ranks of the proposing sequences."""
    seen: ByPosition = {}
    propose = engine.spec.propose

    def recording(items: list[ScheduledItem]) -> dict[str, list[int]]:
        drafts = propose(items)
        for item in items:
            if item.seq_id in drafts:
                seen[(item.seq_id, item.seq.num_tokens)] = drafts[item.seq_id]
                if ranks is not None:
                    ranks.add(item.seq.dp_rank)
        return drafts

    engine.spec.propose = recording  # type: ignore[method-assign]
    return seen


@pytest.fixture(scope="module")
def reference(scenario_reference: dict[str, list[int]]) -> dict[str, list[int]]:
    """The one-rank engine's greedy tokens, without speculation."""
    return scenario_reference


@pytest.fixture(scope="module")
def one_rank_drafts(tiny_bf16_dir: Path, reference: dict[str, list[int]]) -> Drafts:
    """The one-rank speculative engine's drafts on the scenario (its tokens: lossless)."""
    engine = Engine(EngineConfig(model=str(tiny_bf16_dir), **SCENARIO_ENGINE, **SPEC))
    rounds = record_drafts(engine)
    assert run_scenario(engine) == reference
    assert_no_leaks(engine)
    assert sum(len(d) for r in rounds for d in r.values()) > 0, "the rounds must draft"
    return rounds


@pytest.mark.parametrize("layout", TP_LAYOUTS)
def test_tp_group_with_mtp_gives_the_single_rank_tokens_and_drafts(
    layout: str,
    tiny_bf16_dir: Path,
    reference: dict[str, list[int]],
    one_rank_drafts: Drafts,
) -> None:
    with LLM(str(tiny_bf16_dir), **SCENARIO_ENGINE, **LAYOUTS[layout], **SPEC) as llm:
        engine = llm.engine
        rounds = record_drafts(engine)
        tokens = run_scenario(engine)
        assert_no_leaks(engine)
        scheduler = engine.scheduler
        assert scheduler.num_preemptions > 0 and scheduler.prefix_hit_tokens > 0
    assert tokens == reference
    assert rounds == one_rank_drafts


def test_tp_group_mtp_rounds_through_the_graph_path_give_the_single_rank_tokens(
    tiny_bf16_dir: Path,
    reference: dict[str, list[int]],
    one_rank_drafts: Drafts,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every rank of a TP2 group builds the speculative graphs (uncaptured on CPU: the same
    padded path) and rank 0's graphed verify, chain and extend run on the follower too; a
    follower that replayed a different batch, or none, would hang the group or change the
    drafts."""
    monkeypatch.setenv(EAGER_GRAPH_PATH_ENV, "1")  # the spawned rank inherits it
    with LLM(str(tiny_bf16_dir), **SCENARIO_ENGINE, **LAYOUTS["tp2"], **SPEC) as llm:
        engine = llm.engine
        graphs = engine.spec.graphs
        assert graphs is not None and graphs.chain is not None and graphs.extend is not None
        rounds = record_drafts(engine)
        tokens = run_scenario(engine)
        assert_no_leaks(engine)
        runs = (graphs.verify.runs, graphs.chain.runs, graphs.extend.runs)
    assert tokens == reference
    assert rounds == one_rank_drafts
    assert all(n > 0 for n in runs), f"verify, chain and extend graph runs: {runs}"


def test_tp_group_accepting_drafts_matches_the_one_rank_speculative_engine(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    oracle_dir = tmp_path_factory.mktemp("oracle-draft")
    oracle = str(make_oracle_draft_checkpoint(oracle_dir, fp8=False))  # TP splits bf16
    one = Engine(EngineConfig(model=oracle, **SCENARIO_ENGINE, **SPEC))
    one_rounds = record_drafts(one)
    one_tokens = run_scenario(one)
    assert one.spec_stats.accepted_tokens > one.spec_stats.draft_tokens // 2 > 0
    with LLM(oracle, **SCENARIO_ENGINE, **LAYOUTS["tp2"], **SPEC) as llm:
        rounds = record_drafts(llm.engine)
        tokens = run_scenario(llm.engine)
        assert_no_leaks(llm.engine)
        stats = llm.engine.spec_stats
    assert (tokens, rounds) == (one_tokens, one_rounds)
    assert (stats.draft_tokens, stats.accepted_at) == (
        one.spec_stats.draft_tokens,
        one.spec_stats.accepted_at,
    )


@pytest.fixture(scope="module")
def one_rank_by_position(tiny_bf16_dir: Path, reference: dict[str, list[int]]) -> ByPosition:
    engine = Engine(EngineConfig(model=str(tiny_bf16_dir), **SCENARIO_ENGINE, **SPEC))
    seen = drafts_by_position(engine)
    assert run_scenario(engine) == reference
    return seen


@pytest.mark.parametrize("layout", DP_LAYOUTS)
def test_dp_attention_group_with_mtp_gives_the_single_rank_tokens_and_drafts(
    layout: str,
    tiny_bf16_dir: Path,
    reference: dict[str, list[int]],
    one_rank_by_position: ByPosition,
) -> None:
    args = {**SCENARIO_ENGINE, **LAYOUTS[layout], "num_kv_tokens": DP_KV_TOKENS[2], **SPEC}
    ranks: set[int] = set()
    with LLM(str(tiny_bf16_dir), **args) as llm:
        engine = llm.engine
        seen = drafts_by_position(engine, ranks)
        tokens = run_scenario(engine)
        assert_no_leaks(engine)
        scheduler = engine.scheduler
        assert scheduler.num_preemptions > 0 and scheduler.prefix_hit_tokens > 0
    assert tokens == reference
    assert ranks == {0, 1}, "both DP ranks must draft for their sequences"
    both = seen.keys() & one_rank_by_position.keys()
    assert len(both) >= 10, f"too few proposals to compare: {len(both)}"
    # lookahead can differ (each DP rank's pool and batch budget differ): compare the chains
    # up to the shorter one
    short = {k: min(len(seen[k]), len(one_rank_by_position[k])) for k in both}
    assert {k: seen[k][: short[k]] for k in both} == {
        k: one_rank_by_position[k][: short[k]] for k in both
    }


def test_dp_attention_group_accepting_drafts_matches_the_one_rank_tokens(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    oracle_dir = tmp_path_factory.mktemp("oracle-draft-dp")
    oracle = str(make_oracle_draft_checkpoint(oracle_dir, fp8=False))
    one = Engine(EngineConfig(model=oracle, **SCENARIO_ENGINE, **SPEC))
    one_tokens = run_scenario(one)
    args = {**SCENARIO_ENGINE, **LAYOUTS["dp2-ep2"], "num_kv_tokens": DP_KV_TOKENS[2], **SPEC}
    with LLM(oracle, **args) as llm:
        tokens = run_scenario(llm.engine)
        assert_no_leaks(llm.engine)
        stats = llm.engine.spec_stats
    assert tokens == one_tokens
    assert stats.accepted_tokens > stats.draft_tokens // 2 > 0
