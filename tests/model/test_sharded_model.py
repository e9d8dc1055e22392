"""The sharded model (TP, EP, DP attention) against the single-rank model, on real gloo
process groups (2 and 4 CPU processes) and the tiny safetensors checkpoints.

Each rank's shard is filled from the full checkpoint by ``placement_of`` slices, runs the
same steps (TP) or its own DP group's sequences (DP attention, with idle steps), and its
logits must equal the single-rank model's on the same sequences (fp32 compute).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from shard_util import run_ranks
from sharded_cases import Case, dp_steps, rank_worker, reference_logits

from dsv3serve.config import ModelConfig
from dsv3serve.model.deepseek_v3 import DeepseekV3ForCausalLM, DenseMLP, ModelOptions, MoE
from dsv3serve.model.sharding import Sharding
from dsv3serve.model.tiny import make_tiny_checkpoint
from dsv3serve.parallel.config import LayoutError, ParallelConfig
from dsv3serve.parallel.shard import RankLayout

TOL = {"rtol": 1e-4, "atol": 1e-4}  # fp32: only the summation order differs
# With FP8 activation quantisation that order noise (~1e-6) now and then moves a value across
# an e4m3 rounding boundary (a 1/16 step), and the tiny random model amplifies it layer by
# layer: the sharded logits must then be well inside the quantisation's own effect (the
# single-rank model with vs without activation quantisation), at every step.
FP8_FLIP_SHARE = 0.5
# heads * dims and the shared expert's width split on 128 boundaries over 2 ranks
FP8_SPLITTABLE = {
    "qk_nope_head_dim": 64,
    "qk_rope_head_dim": 64,
    "v_head_dim": 64,
    "moe_intermediate_size": 256,
}
TP2 = ParallelConfig(tp_size=2)
TP2_EP2 = ParallelConfig(tp_size=2, ep_size=2)
DP2 = ParallelConfig(tp_size=2, dp_size=2, enable_dp_attention=True, ep_size=2)
DP2_LM = DP2.model_copy(update={"enable_dp_lm_head": True})
TP4_EP4 = ParallelConfig(tp_size=4, ep_size=4)


@pytest.fixture(scope="module")
def fp8_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tiny_fp8_split")
    return make_tiny_checkpoint(out, fp8=True, overrides=FP8_SPLITTABLE)


@pytest.fixture(scope="module")
def two_rank_cases(tiny_bf16_dir: Path, fp8_dir: Path) -> dict[str, Case]:
    bf16, fp8 = str(tiny_bf16_dir), str(fp8_dir)
    cases = [
        Case("tp2", TP2, bf16),
        Case("tp2_ep2", TP2_EP2, bf16),
        Case("dp2_ep2", DP2, bf16, dp_steps()),
        Case("dp2_ep2_dp_lm_head", DP2_LM, bf16, dp_steps()),
        Case("tp2_ep2_fp8", TP2_EP2, fp8, act_quant=False),
        Case("tp2_ep2_fp8_act_quant", TP2_EP2, fp8),
        Case("tp2_no_o_proj_all_reduce", TP2, bf16, break_o_proj_reduce=True),
    ]
    return {c.name: c for c in cases}


@pytest.fixture(scope="module")
def two_rank_results(two_rank_cases: dict[str, Case], tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("two_rank")
    run_ranks(2, rank_worker, list(two_rank_cases.values()), str(out))
    return out


@pytest.fixture(scope="module")
def four_rank_results(tiny_bf16_dir: Path, tmp_path_factory) -> tuple[Case, Path]:
    out = tmp_path_factory.mktemp("four_rank")
    case = Case("tp4_ep4", TP4_EP4, str(tiny_bf16_dir))
    run_ranks(4, rank_worker, [case], str(out))
    return case, out


def _results(case: Case, out: Path) -> list[dict]:
    ranks = case.parallel.world_size
    return [torch.load(out / f"{case.name}-rank{r}.pt") for r in range(ranks)]


def _assert_matches(case: Case, out: Path, tol: dict[str, float]) -> None:
    ref = reference_logits(case)
    for rank, result in enumerate(_results(case, out)):
        for step, logits in enumerate(result["logits"]):
            want = ref[step][result["group"]]
            torch.testing.assert_close(
                logits, want, **tol, msg=lambda m, r=rank, s=step: f"rank {r} step {s}: {m}"
            )


def _rel_norm(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).norm() / want.norm())


def _assert_shard_facts(case: Case, out: Path, num_experts: int) -> None:
    per_rank = num_experts // case.parallel.ep_size
    for rank, result in enumerate(_results(case, out)):
        assert result["param_bytes"] == result["held_bytes"], f"rank {rank}"
        assert result["stack_slots"] == [per_rank]
        first = RankLayout(case.parallel, rank).expert_range(num_experts).start
        assert result["stack_experts"] == [(first, per_rank)]


@pytest.mark.parametrize("name", ["tp2", "tp2_ep2", "dp2_ep2", "dp2_ep2_dp_lm_head"])
def test_two_ranks_match_single_rank(name: str, two_rank_cases, two_rank_results) -> None:
    _assert_matches(two_rank_cases[name], two_rank_results, TOL)


@pytest.mark.parametrize("name", ["tp2", "tp2_ep2", "dp2_ep2", "dp2_ep2_dp_lm_head"])
def test_two_rank_shards_hold_their_slices(name: str, two_rank_cases, two_rank_results) -> None:
    _assert_shard_facts(two_rank_cases[name], two_rank_results, 16)


def test_fp8_tp2_ep2_matches_single_rank(two_rank_cases, two_rank_results) -> None:
    """e4m3 weights and 128x128 scales sliced on block boundaries (activations unquantised:
    exact up to summation order)."""
    case = two_rank_cases["tp2_ep2_fp8"]
    _assert_matches(case, two_rank_results, TOL)
    _assert_shard_facts(case, two_rank_results, 16)


def test_fp8_act_quant_tp2_ep2_close_to_single_rank(two_rank_cases, two_rank_results) -> None:
    case = two_rank_cases["tp2_ep2_fp8_act_quant"]
    ref = reference_logits(case)
    unquantised = reference_logits(dataclasses.replace(case, act_quant=False))
    for rank, result in enumerate(_results(case, two_rank_results)):
        for step, logits in enumerate(result["logits"]):
            err = _rel_norm(logits, ref[step][0])
            quant_effect = _rel_norm(ref[step][0], unquantised[step][0])
            assert err < FP8_FLIP_SHARE * quant_effect, f"rank {rank} step {step}: {err}"


def test_missing_o_proj_all_reduce_is_caught(two_rank_cases, two_rank_results) -> None:
    """The comparison can fail: attention without its all-reduce gives other logits."""
    with pytest.raises(AssertionError):
        _assert_matches(two_rank_cases["tp2_no_o_proj_all_reduce"], two_rank_results, TOL)


def test_tp4_ep4_matches_single_rank(four_rank_results) -> None:
    case, out = four_rank_results
    _assert_matches(case, out, TOL)
    _assert_shard_facts(case, out, 16)


def test_fp8_split_off_128_boundary_is_refused(tiny_fp8_dir: Path) -> None:
    cfg = ModelConfig.from_hf(tiny_fp8_dir)  # q_b_proj has 4 * 48 = 192 rows: 96 per rank
    opts = ModelOptions(torch.float32, layout=RankLayout(TP2, 0))
    with pytest.raises(LayoutError, match="q_b_proj.*128 boundary"):
        DeepseekV3ForCausalLM(cfg, opts)


def test_layout_needs_a_matching_comm(tiny_bf16_dir: Path) -> None:
    cfg = ModelConfig.from_hf(tiny_bf16_dir)
    opts = ModelOptions(torch.float32, layout=RankLayout(TP2, 1))
    with pytest.raises(LayoutError, match="comm over the layout's 2 ranks, found one over 1"):
        DeepseekV3ForCausalLM(cfg, opts)


@pytest.mark.parametrize("parallel", [TP2, TP2_EP2, DP2])
def test_shared_fusion_refused_when_sharded(tiny_bf16_dir: Path, parallel) -> None:
    cfg = ModelConfig.from_hf(tiny_bf16_dir)
    layout = RankLayout(parallel, 0)
    prefix = "model.layers.1.mlp"
    with pytest.raises(ValueError, match="shared_experts_fusion 'on': expected"):
        MoE(cfg, prefix, ModelOptions(torch.float32, shared_experts_fusion="on", layout=layout))
    auto = ModelOptions(torch.float32, moe_backend="triton", layout=layout)
    assert MoE(cfg, prefix, auto).experts.shared_slots == 0


def test_a_part_with_another_layout_than_its_options_is_refused(tiny_bf16_dir: Path) -> None:
    """The layout has one source: a part handed a sharding for another layout refuses it."""
    cfg = ModelConfig.from_hf(tiny_bf16_dir)
    tp2 = RankLayout(ParallelConfig(tp_size=2), 0)
    opts = ModelOptions(dtype=torch.float32, layout=tp2)
    with pytest.raises(LayoutError, match="expected the part's sharding for the options' layout"):
        DenseMLP(cfg, "model.layers.0.mlp", cfg.intermediate_size, opts, Sharding(None))
    assert DenseMLP(cfg, "model.layers.0.mlp", cfg.intermediate_size, opts).shard.layout == tp2
