"""``benchmarks/group_step_report.py``: issue 35's tables from two ``bench group`` JSONs.
Inputs are written here by hand, in the JSON's shape; expected cells are worked out by hand."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "group_step_report.py"


def profile(wall: float, span: float, cats: dict[str, float]) -> dict[str, Any]:
    kernel = sum(cats.values())
    return {"wall_ms": wall, "span_ms": span, "host_idle_ms": wall - span,
            "kernel_ms": kernel, "calls": 3, "categories_ms": cats}  # fmt: skip


ONE = {
    "decode": [
        {
            "per_rank": 64,
            "median_step_ms": 10.0,
            "x_roofline": 1.2,
            "tok_s_per_gpu": 6400.0,
            "profile": profile(10.5, 10.0, {"moe_experts": 6.0, "attention": 2.0}),
        },
        {"per_rank": 256, "median_step_ms": 20.0, "x_roofline": 1.3, "tok_s_per_gpu": 12800.0},
    ],  # fmt: skip
    "prefill": {"length": 4096, "tok_s_per_gpu": 10000.0},
}
GROUP = {
    "decode": [
        {
            "per_rank": 64,
            "median_step_ms": 14.0,
            "x_roofline": 1.4,
            "tok_s_per_gpu": 4571.0,
            "profile": profile(15.0, 12.0, {"collective": 3.0, "moe_experts": 5.5}),
        },
        {"per_rank": 256, "median_step_ms": 43.4, "x_roofline": 3.02, "tok_s_per_gpu": 5898.0},
    ],  # fmt: skip
    "prefill": {"length": 4096, "tok_s_per_gpu": 7500.0},
}


def run(tmp_path: Path, one: dict[str, Any], group: dict[str, Any]) -> str:
    (tmp_path / "one.json").write_text(json.dumps(one))
    (tmp_path / "group.json").write_text(json.dumps(group))
    cmd = [sys.executable, str(SCRIPT), str(tmp_path / "one.json"), str(tmp_path / "group.json")]
    done = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=ROOT)
    return done.stdout


def test_decode_rows_judge_each_batch_by_its_bound(tmp_path: Path) -> None:
    out = run(tmp_path, ONE, GROUP)
    assert "| 64 | 10.00, 1.20 | 14.00, 1.40 | 6400, 4571 | 1.5 | yes |" in out
    assert "| 256 | 20.00, 1.30 | 43.40, 3.02 | 12800, 5898 | 1.6 | no |" in out


def test_a_row_whose_batch_was_not_full_is_not_judged(tmp_path: Path) -> None:
    # as on two H200s on 2026-11-29 before the fix: sequences ran out of budget and a
    # "256 per rank" step decoded 165 of 256 (one GPU) and 321 of 512 (the group)
    def partial(row: dict[str, Any], seqs: int, least: int) -> dict[str, Any]:
        return {**row, "sequences": seqs, "full_batch": False, "min_tokens_per_step": least}

    one = {**ONE, "decode": [ONE["decode"][0], partial(ONE["decode"][1], 256, 165)]}
    group = {**GROUP, "decode": [GROUP["decode"][0], partial(GROUP["decode"][1], 512, 321)]}
    out = run(tmp_path, one, group)
    assert (
        "| 1.6 | group: batch not full, 321 of 512 (one GPU: batch not full, 165 of 256) |" in out
    )
    assert "| 6400, 4571 | 1.5 | yes |" in out  # full rows, and rows of older JSONs, are judged


def test_prefill_share_of_one_gpu(tmp_path: Path) -> None:
    out = run(tmp_path, ONE, GROUP)
    assert "7500 tok/s per GPU = 75.0% of one GPU (bound 80%: does not hold)" in out


def test_profiles_side_by_side_with_every_kind_of_op(tmp_path: Path) -> None:
    out = run(tmp_path, ONE, GROUP)
    assert "| ms per step (one GPU / group) | decode@64 |" in out
    assert "| host_idle_ms | 0.50 / 3.00 |" in out
    assert "| kernel_ms | 8.00 / 8.50 |" in out
    # a kind only one side ran reads 0 on the other
    assert "| attention | 2.00 / 0.00 |" in out and "| collective | 0.00 / 3.00 |" in out


def test_runs_without_gpu_profiles_say_so(tmp_path: Path) -> None:
    cpu_one = {"decode": [{**ONE["decode"][1], "profile": {"calls": 3, "skipped": "CUDA only"}}]}
    out = run(tmp_path, cpu_one, GROUP)
    assert "profile: no step profiled on a GPU in both runs" in out
    assert "prefill: not measured in both runs" in out
