"""Which FP8 GEMM runs where, from the config alone (dsv3serve/plan/gemm.py): the rank's
dense GEMM shapes through the shard rule, the backend ranges with and without a measured
DeepGEMM table, and `dsv3serve plan --gpu-name`."""

from __future__ import annotations

from pathlib import Path

from test_planner import _cli

from dsv3serve.kernels.gemm_table import Measured, table_path, write_section
from dsv3serve.parallel.config import ParallelConfig
from dsv3serve.parallel.shard import RankLayout
from dsv3serve.plan.cli import model_config
from dsv3serve.plan.gemm import dense_gemm_shapes, device_table, gemm_json, gemm_report

V3 = model_config("deepseek-v3")


def test_full_width_shapes() -> None:
    shapes = dense_gemm_shapes(V3, None)
    assert shapes["self_attn.qkv_a_proj"] == (2112, 7168)  # q_a 1536 + kv_a 576, packed
    assert shapes["self_attn.o_proj"] == (7168, 16384)
    assert shapes["mlp.gate_proj"] == (18432, 7168)
    assert shapes["mlp.down_proj"] == (7168, 18432)
    assert shapes["mlp.shared_experts.down_proj"] == (7168, 2048)
    assert "self_attn.q_a_proj" not in shapes and "mlp.experts.0.up_proj" not in shapes


def test_tp8_shapes_follow_the_shard_rule() -> None:
    shapes = dense_gemm_shapes(V3, RankLayout(ParallelConfig(tp_size=8), 0))
    assert shapes["self_attn.q_b_proj"] == (24576 // 8, 1536)  # column-parallel
    assert shapes["self_attn.o_proj"] == (7168, 16384 // 8)  # row-parallel
    assert shapes["self_attn.qkv_a_proj"] == (2112, 7168)  # replicated


def test_report_without_and_with_a_table(tmp_path: Path) -> None:
    lines = gemm_report(V3, None, 8192, "NVIDIA H200", device_table("NVIDIA H200", tmp_path))
    assert "no measured DeepGEMM table" in lines[0]
    o_proj = next(s for s in lines if "self_attn.o_proj" in s)
    assert o_proj.endswith("triton M 1-63, cublas M 64-8192")
    pts = [Measured(m, 10.0, "cublas", 12.0) for m in (1024, 2048, 4096, 8192)]
    env = {"date": "2026-12-06"}
    write_section(table_path("NVIDIA H200", tmp_path), "dense", {"N=7168,K=16384": pts}, env)
    table = device_table("NVIDIA H200", tmp_path)
    lines = gemm_report(V3, None, 8192, "NVIDIA H200", table)
    assert "measured 2026-12-06" in lines[0]
    o_proj = next(s for s in lines if "self_attn.o_proj" in s)
    assert o_proj.endswith("triton M 1-63, cublas M 64-1023, deepgemm M 1024-8192")
    unusable = gemm_report(V3, None, 8192, "NVIDIA H200", table, (False, "DeepGEMM unusable"))
    assert "deepgemm" not in next(s for s in unusable if "self_attn.o_proj" in s)
    data = gemm_json(V3, None, 8192, "NVIDIA H200", table)
    last = data["linears"]["self_attn.o_proj"]["ranges"][-1]
    assert last == {"first_m": 1024, "last_m": 8192, "backend": "deepgemm"}


def test_cli_names_the_backends() -> None:
    out = _cli("--model", "deepseek-v3", "--tp-size", "8", "--gpu-memory-gb", "141",
               "--gpu-name", "NVIDIA H200")  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "FP8 GEMM backends on NVIDIA_H200" in out.stdout
    assert "self_attn.o_proj" in out.stdout and "cublas M 128-8192" in out.stdout
    assert out.stdout.rstrip().endswith("fits")
