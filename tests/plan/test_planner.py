"""The memory planner: published DeepSeek-V3 layouts, checkpoint byte totals, the tiny loader."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from shard_standin import ALIGNED_TP2, SMALL, LocalShapeStandIn

from dsv3serve.config import ModelConfig
from dsv3serve.model.presets import DEEPSEEK_V3_CONFIG
from dsv3serve.model.shard_load import read_index
from dsv3serve.model.tiny import checkpoint_shapes, is_quantized, make_tiny_checkpoint
from dsv3serve.model.weights import load_checkpoint, shard_files
from dsv3serve.parallel.config import ParallelConfig
from dsv3serve.parallel.shard import RankLayout
from dsv3serve.plan.planner import (
    GB,
    KINDS,
    PlanError,
    checkpoint_infos,
    kind_of,
    kv_bytes_per_token,
    nextn_shared_names,
    plan,
)

V3 = ModelConfig.from_dict(DEEPSEEK_V3_CONFIG)
REPO = Path(__file__).resolve().parents[2]


def dp_ep(n: int) -> ParallelConfig:
    return ParallelConfig(tp_size=n, dp_size=n, enable_dp_attention=True, ep_size=n)


def independent_bytes(config: dict, skip: tuple[str, ...] = ()) -> int:
    """numel x itemsize of every checkpoint tensor: e4m3 + one float32 per 128x128 block for
    FP8 projections, float32 router bias, bf16 for the rest."""
    total = 0
    for name, shape in checkpoint_shapes(config).items():
        if name.startswith(skip):
            continue
        n = math.prod(shape)
        if is_quantized(name):
            total += n + 4 * math.prod(-(-s // 128) for s in shape)
        else:
            total += n * (4 if name.endswith("e_score_correction_bias") else 2)
    return total


def test_one_rank_holds_the_whole_checkpoint() -> None:
    p = plan(V3, ParallelConfig(), gpu_memory_gb=1000)
    (rank,) = p.ranks
    skip = nextn_shared_names(V3)
    assert rank.weights_total == independent_bytes(DEEPSEEK_V3_CONFIG, skip)
    # the checkpoint: 684.5B values, 688.6 GB; the model shares NextN's embedding and head
    assert independent_bytes(DEEPSEEK_V3_CONFIG) == pytest.approx(688.57e9, rel=1e-4)
    assert rank.weights_total / GB == pytest.approx(684.87, abs=0.01)
    assert rank.absorbed_mla_bytes == 62 * 128 * 256 * 512 * 2


def test_8xh200_dp8_ep8_fits_at_about_100gb_per_rank() -> None:
    p = plan(V3, dp_ep(8), gpu_memory_gb=141)
    assert len({r.weight_bytes["routed_experts"] for r in p.ranks}) == 1
    w = p.worst.weight_bytes
    assert w["attention"] / GB == pytest.approx(11.4, abs=0.1)  # replicated
    assert w["routed_experts"] / GB == pytest.approx(82.0, abs=0.1)  # 32 of 256 experts
    rest = sum(w[k] for k in KINDS if k not in ("attention", "routed_experts"))
    assert rest / GB == pytest.approx(7.7, abs=0.1)
    assert p.worst.weights_total / GB == pytest.approx(101.1, abs=0.1)
    assert p.kv_tokens > 163840  # a whole max-length request per DP rank


def test_16xh100_ep16_fits() -> None:
    p = plan(V3, dp_ep(16), gpu_memory_gb=80)
    assert p.worst.weight_bytes["routed_experts"] / GB == pytest.approx(41.1, abs=0.1)
    assert p.kv_tokens >= p.min_kv_tokens > 0


def test_16xh100_ep16_cannot_hold_a_full_context_request() -> None:
    with pytest.raises(PlanError, match=r"KV cache of \d+ tokens .* below the 163840 tokens"):
        plan(V3, dp_ep(16), gpu_memory_gb=80, context_length=163840)


@pytest.mark.parametrize("ep", [1, 8])
def test_tp_only_8xh100_is_refused_with_the_numbers(ep: int) -> None:
    with pytest.raises(PlanError) as err:
        plan(V3, ParallelConfig(tp_size=8, ep_size=ep), gpu_memory_gb=80)
    msg = str(err.value)
    assert "weights 88.4 GB" in msg and "> 68.0 GB" in msg, msg
    assert err.value.plan is not None


def test_planned_shapes_are_the_tiny_checkpoints_own(tmp_path) -> None:
    model_dir = make_tiny_checkpoint(tmp_path, fp8=True, overrides=SMALL)
    on_disk = read_index(shard_files(model_dir))
    planned = checkpoint_infos(ModelConfig.from_hf(model_dir))
    assert {n: (i.shape, i.dtype) for n, i in on_disk.items()} == {
        n: (i.shape, i.dtype) for n, i in planned.items()
    }


@pytest.fixture(scope="module")
def tiny_fp8(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("tiny")
    return make_tiny_checkpoint(root, fp8=True, num_shards=2, overrides=ALIGNED_TP2)


@pytest.mark.parametrize("parallel", [ParallelConfig(tp_size=2), dp_ep(2)], ids=["tp2", "dp2_ep2"])
def test_tiny_plan_matches_what_each_rank_loads(tiny_fp8: Path, parallel) -> None:
    cfg = ModelConfig.from_hf(tiny_fp8)
    p = plan(cfg, parallel, gpu_memory_gb=10)
    for rank in range(parallel.world_size):
        layout = RankLayout(parallel, rank)
        model = LocalShapeStandIn(tiny_fp8, layout)
        load_checkpoint(model, tiny_fp8, layout)
        loaded = dict.fromkeys(KINDS, 0)
        for name, target in model.checkpoint_targets().items():
            loaded[kind_of(name, cfg.num_hidden_layers)] += target.view().nbytes
        params = sum(t.nbytes for t in model.params.values())
        assert p.ranks[rank].weight_bytes == loaded
        assert p.ranks[rank].weights_total == params


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "dsv3serve.cli", "plan", *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)


def test_cli_prints_the_table_and_fits() -> None:
    out = _cli(
        "--model",
        "tiny",
        "--tp-size",
        "2",
        "--dp-size",
        "2",
        "--enable-dp-attention",
        "--ep-size",
        "2",
        "--gpu-memory-gb",
        "10",
    )
    assert out.returncode == 0, out.stderr
    for row in ("routed_experts", "weights total", "CUDA-graph reserve", "KV capacity"):
        assert row in out.stdout
    assert out.stdout.rstrip().endswith("fits")


def test_cli_refusal_exits_2_with_the_numbers() -> None:
    out = _cli(
        "--model", "deepseek-v3", "--tp-size", "8", "--ep-size", "8", "--gpu-memory-gb", "80"
    )
    assert out.returncode == 2
    assert "does not fit" in out.stderr and "88.4 GB" in out.stderr and "68.0 GB" in out.stderr
    assert "does not fit" in out.stdout  # the table is still printed


def test_host_tier_memory_is_reported_by_ratio_and_by_size() -> None:
    off = plan(V3, dp_ep(8), gpu_memory_gb=141)
    by_ratio = plan(V3, dp_ep(8), gpu_memory_gb=141, hicache_ratio=2.0)
    by_size = plan(V3, dp_ep(8), gpu_memory_gb=141, hicache_size=100)
    assert off.host_kv_bytes == 0 and by_ratio.kv_tokens == off.kv_tokens
    assert by_ratio.host_kv_tokens == 2 * off.kv_tokens
    assert by_ratio.host_kv_bytes == 2 * off.kv_bytes
    assert 100e9 - 64 * by_size.kv_bytes_per_token < by_size.host_kv_bytes <= 100e9


def test_cli_reports_the_host_tier_and_refuses_sizes_without_it() -> None:
    base = ("--model", "deepseek-v3", "--tp-size", "8", "--dp-size", "8")
    base += ("--enable-dp-attention", "--ep-size", "8", "--gpu-memory-gb", "141")
    out = _cli(*base, "--enable-hierarchical-cache", "--hicache-size", "200")
    assert out.returncode == 0, out.stderr
    assert "host tier (hierarchical cache): 200.00 GB host memory per rank" in out.stdout
    refused = _cli(*base, "--hicache-ratio", "2")
    assert refused.returncode == 2 and "add --enable-hierarchical-cache" in refused.stderr


def test_eplb_redundant_slots_are_counted() -> None:
    """32 redundant experts at EP8: 4 more slots per rank on 58 MoE layers (+ NextN's)."""
    base = plan(V3, dp_ep(8), gpu_memory_gb=141).worst.weight_bytes
    eplb = dp_ep(8).model_copy(update={"ep_num_redundant_experts": 32})
    more = plan(V3, eplb, gpu_memory_gb=141).worst.weight_bytes
    expert = 3 * 7168 * 2048 + 4 * (2 * 56 * 16 + 16 * 56)  # e4m3 + block scales
    assert more["routed_experts"] - base["routed_experts"] == 4 * 58 * expert
    assert more["nextn"] - base["nextn"] == 4 * expert
    assert more["routed_experts"] / GB == pytest.approx(92.2, abs=0.1)


def test_fp8_kv_is_half_the_bf16_bytes_with_flashmlas_per_layer_scales() -> None:
    """flashinfer's fp8 pool (the Triton decode kernel) keeps a float32 scale per token
    (580 bytes a token-layer); FlashMLA's keeps one per layer (576: half of bf16)."""
    layers = V3.num_hidden_layers + V3.num_nextn_predict_layers
    bf16 = kv_bytes_per_token(V3, "auto")
    assert bf16 == layers * 576 * 2
    assert kv_bytes_per_token(V3, "fp8_e4m3", "flashinfer") == layers * 580
    assert kv_bytes_per_token(V3, "fp8_e4m3", "flashmla") * 2 == bf16
    assert kv_bytes_per_token(V3, "auto", "flashmla") == bf16
    common = {"gpu_memory_gb": 141, "kv_cache_dtype": "fp8_e4m3"}
    fi = plan(V3, dp_ep(8), **common)
    fm = plan(V3, dp_ep(8), **common, attention_backend="flashmla")
    assert fm.kv_bytes_per_token * 2 == bf16 and fm.kv_tokens > fi.kv_tokens
