"""``dsv3serve bench group``: the group's ranks start (gloo on CPU), every batch and the
prefill are measured and written; the roofline's byte count of a rank agrees with the
memory planner's (another code path: checkpoint shapes, not the loaded model)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from dsv3serve.bench.engine.group_roofline import (
    RankBytes,
    hit_fraction,
    rank_bytes,
    step_bytes,
    to_ep,
    to_full_depth,
)
from dsv3serve.engine.config import EngineConfig
from dsv3serve.engine.engine import Engine
from dsv3serve.parallel.config import ParallelConfig
from dsv3serve.plan.cli import model_config
from dsv3serve.plan.planner import plan


def test_cli_runs_a_dp2_ep2_group_and_writes_every_batch(tmp_path: Path) -> None:
    out = tmp_path / "group.json"
    cmd = [sys.executable, "-m", "dsv3serve.cli", "bench", "group", "--model", "tiny",
           "--tp-size", "2", "--dp-size", "2", "--enable-dp-attention", "--ep-size", "2",
           "--per-rank", "1", "40", "--ctx", "16", "--steps", "3", "--prefill-per-rank", "1",
           "--prefill-len", "32", "--chunked-prefill-size", "64",
           "--max-num-batched-tokens", "64", "--profile-steps", "12",
           "--json", str(out)]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert [r["per_rank"] for r in result["decode"]] == [1, 40]
    assert [r["sequences"] for r in result["decode"]] == [2, 80]  # dp_size x per rank
    assert all(r["median_step_ms"] > 0 and r["tok_s_per_gpu"] > 0 for r in result["decode"])
    assert result["prefill"]["prompts"] == 2 and "per rank" in done.stdout
    # 40 prompts of 16 tokens take 10 prefill steps of 64 tokens a rank, and the first ones
    # decode meanwhile: every timed and profiled step (more than the old budget's slack of
    # 8 tokens) still runs the whole batch, one token per sequence (device ops need CUDA)
    assert result["decode"][1]["prefill_steps"] >= 10
    for r in result["decode"]:
        assert r["full_batch"] and r["min_tokens_per_step"] == r["sequences"]
        assert r["profile"]["tokens_per_step"] == [r["sequences"]] * 12
        assert r["profile"]["skipped"].startswith("CUDA only")
    # the profiled prefill steps are as full as the timed ones: 64 prompt tokens per rank
    # a step, two 32-token prompts finishing on each of the 2 ranks
    assert result["prefill"]["profile"]["tokens_per_step"] == [2 * 2] * 12
    assert done.stdout.count("profile (rank 0, ms per step, 12 steps)") == 3


def test_rank_bytes_agree_with_the_planner(tiny_fp8_dir: Path) -> None:
    engine = Engine(EngineConfig(model=str(tiny_fp8_dir), dtype="bfloat16", num_kv_tokens=256))
    model = engine.runner.model
    b = rank_bytes(model, 0, 0)
    planned = plan(model_config(str(tiny_fp8_dir)), ParallelConfig(), 80).ranks[0].weight_bytes
    # the planner files each layer's router (bf16 gate [E, H], float32 bias [E]) under
    # routed experts; a decode step reads it whatever it routes to, so the roofline counts
    # it (kept in float32 by the model) as "other"
    c = model.cfg
    router = b.moe_layers * (c.n_routed_experts * c.hidden_size * 2 + c.n_routed_experts * 4)
    assert b.experts + router == planned["routed_experts"]
    # ... and the final norm (bf16 [H]) beside the LM head, which the roofline files as "other"
    assert b.head + c.hidden_size * 2 == planned["embedding"] + planned["lm_head"]


def test_projections_scale_the_bytes_not_the_ratio() -> None:
    b = RankBytes(experts=90, head=10, other=12, kv=24, layers=12, moe_layers=9)
    full = to_full_depth(b)
    assert (full.experts, full.other, full.kv, full.head) == (580, 61, 122, 10)
    assert to_ep(full, 2, 8).experts == 145
    assert hit_fraction(1, 8, 256) == pytest.approx(1 - (255 / 256) ** 8)
    assert step_bytes(b, 10**6, 8, 256) == pytest.approx(136)  # every expert hit
