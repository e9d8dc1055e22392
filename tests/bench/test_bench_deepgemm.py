"""The DeepGEMM bench's bookkeeping on the CPU (the timing itself needs a GPU): shapes,
which rows become table points (accurate DeepGEMM, a baseline that ran), the table written
from a result, and the printed rows when DeepGEMM is missing."""

from __future__ import annotations

from pathlib import Path

from dsv3serve.bench.kernels.deepgemm import dense_shapes, dense_table_points, measured, print_dense
from dsv3serve.bench.kernels.deepgemm_moe import contiguous_key, masked_key, print_moe
from dsv3serve.bench.kernels.deepgemm_run import write_deepgemm_table
from dsv3serve.kernels.gemm_table import load_table, table_path


def _row(m: int, dg: dict | None, baseline: str = "cublas", base_us: float = 12.0) -> dict:
    row = {"shape": "self_attn.o_proj", "N": 7168, "K": 16384, "M": m, "baseline": baseline}
    row[baseline] = {"us": base_us, "rel_err": 2e-3, "timing": "graph"}
    if dg is not None:
        row["deepgemm"] = dg
    row["TFLOPs_deepgemm"] = 0.0
    return row


def test_dense_shapes_are_distinct_and_sharded() -> None:
    full = dense_shapes(1)
    assert full["self_attn.o_proj"] == (7168, 16384)
    assert "mlp.up_proj" not in full  # the same N x K as gate_proj: timed once
    assert dense_shapes(8)["self_attn.o_proj"] == (7168, 2048)


def test_only_accurate_points_become_table_points() -> None:
    ok = _row(1024, {"us": 10.0, "rel_err": 2e-3, "timing": "graph"})
    wrong = _row(2048, {"us": 10.0, "rel_err": 0.3, "timing": "graph"})
    failed = _row(4096, {"error": "RuntimeError: NVCC failed"})
    missing = _row(8192, None)
    point = measured(ok)
    assert point is not None and point.speedup == 1.2 and point.baseline == "cublas"
    assert all(measured(r) is None for r in (wrong, failed, missing))
    assert dense_table_points([ok, wrong, failed, missing]) == {"N=7168,K=16384": [point]}


def test_write_table_from_a_result(tmp_path: Path) -> None:
    moe = {"T": 1024, "E": 256, "baseline": "triton", "triton": {"us": 900.0, "rel_err": 5e-3}}
    moe["deepgemm"] = {"us": 600.0, "rel_err": 6e-3}
    masked = {"T": 64, "E": 32, "M": 1024, "ep": 8, "rows": 500, "baseline": "triton"}
    masked |= {"triton": {"us": 80.0, "rel_err": 5e-3}, "deepgemm": {"us": 100.0, "rel_err": 5e-3}}
    dense = [_row(1024, {"us": 10.0, "rel_err": 2e-3})]
    result = {"deep_gemm": "2.1.1", "dense": dense, "contiguous": [moe], "masked": [masked]}
    path = table_path("NVIDIA H100 80GB HBM3", tmp_path)
    write_deepgemm_table(result, path, {"gpu": "NVIDIA H100 80GB HBM3", "date": "2026-12-06"})
    table = load_table("NVIDIA H100 80GB HBM3", tmp_path)
    assert table is not None and table.environment["deep_gemm"] == "2.1.1"
    assert table.dense_wins(1024, 7168, 16384)
    assert table.points("contiguous", contiguous_key(256))[0].speedup == 1.5
    assert table.points("masked", masked_key(32, 1024))[0].speedup == 0.8


def test_tables_print_without_deepgemm(capsys) -> None:  # noqa: ANN001
    print_dense([_row(64, None, "triton", 20.0)])
    masked = {"T": 16, "E": 32, "M": 1024, "ep": 8, "rows": 100, "baseline": "triton"}
    print_moe("masked", [masked | {"triton": {"us": 50.0, "rel_err": 4e-3}}])
    out = capsys.readouterr().out
    assert "self_attn.o_proj" in out and "E=32 M=1024 rows=100" in out
