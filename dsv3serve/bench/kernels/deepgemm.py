"""``dsv3serve bench kernels --only deepgemm``: DeepGEMM against what runs without it, on
DeepSeek-V3's shapes, each result with its error against the float32 torch reference.

* dense: every FP8 linear of one rank (``--deepgemm-tp``; shapes from
  :func:`dsv3serve.plan.gemm.dense_gemm_shapes`) at decode M (64..256) and prefill M
  (1024..8192): DeepGEMM ``fp8_gemm_nt`` vs cuBLAS block scaling (``scaled_mm``) vs the
  Triton kernel; the baseline is what the ``auto`` dispatch runs without DeepGEMM;
* contiguous and masked MoE: :mod:`dsv3serve.bench.kernels.deepgemm_moe`.

Times are CUDA-graph medians (:mod:`dsv3serve.bench.kernels.timing`); where a graph cannot
capture a call the row says ``eager`` and events time eager calls. ``--write-deepgemm-table``
stores the points whose DeepGEMM result was within :data:`ERROR_LIMIT` of the reference in
this GPU's table (:mod:`dsv3serve.kernels.gemm_table`), which the dispatch then follows.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch

from dsv3serve.bench.kernels.fp8 import weight_copies
from dsv3serve.bench.kernels.timing import graph_us
from dsv3serve.kernels import deepgemm
from dsv3serve.kernels.fp8_gemm import (
    choose_backend,
    cublas_supported,
    fp8_block_gemm_cublas,
    fp8_block_gemm_triton,
)
from dsv3serve.kernels.fp8_quant import quant_per_token_group_fp8
from dsv3serve.kernels.fp8_ref import dequant_per_token_group, dequant_weight_block
from dsv3serve.kernels.gemm_table import Measured, dense_key
from dsv3serve.parallel.config import ParallelConfig
from dsv3serve.parallel.shard import RankLayout
from dsv3serve.plan.cli import model_config
from dsv3serve.plan.gemm import dense_gemm_shapes

DENSE_MS = (64, 128, 256, 1024, 2048, 4096, 8192)
ERROR_LIMIT = 1e-2  # bf16 output of a float32 accumulation: expected ~2e-3


def dense_shapes(tp: int) -> dict[str, tuple[int, int]]:
    """DeepSeek-V3's FP8 linears on rank 0 of a TP ``tp`` layout, one per distinct N x K."""
    layout = RankLayout(ParallelConfig(tp_size=tp), 0) if tp > 1 else None
    by_shape: dict[tuple[int, int], str] = {}
    for name, shape in dense_gemm_shapes(model_config("deepseek-v3"), layout).items():
        by_shape.setdefault(shape, name)
    return {name: shape for shape, name in by_shape.items()}


def eager_us(fn: Callable[[int], Any], calls: int, replays: int) -> float:
    """Median time of one call from events around ``calls`` eager calls."""
    fn(0)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(replays):
        start.record()
        for i in range(calls):
            fn(i)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times) * 1e3 / calls


def time_call(fn: Callable[[int], Any], calls: int, replays: int) -> tuple[float, str]:
    """CUDA-graph timing, or eager timing where the call cannot be captured."""
    try:
        return graph_us(fn, calls, replays), "graph"
    except Exception:  # a library call that cannot be captured: time it eagerly
        torch.cuda.synchronize()
        return eager_us(fn, calls, replays), "eager"


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.float() - ref).norm() / ref.norm().clamp(min=1e-30))


def _path(fn: Callable[[int], torch.Tensor], ref: torch.Tensor, calls: int, reps: int) -> dict:
    """One backend at one point: its time and error, or why it did not run."""
    try:
        err = rel_err(fn(0), ref)
        us, how = time_call(fn, calls, reps)
    except Exception as e:  # unsupported shape, JIT failure: recorded, not fatal
        return {"error": f"{type(e).__name__}: {str(e)[:200]}"}
    return {"us": us, "rel_err": err, "timing": how}


def dense_point(
    module: ModuleType | None, name: str, weights: list, m: int, args: argparse.Namespace
) -> dict[str, Any]:
    """DeepGEMM, cuBLAS and Triton on one M x N x K, against the float32 reference."""
    n, k = weights[0][0].shape
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    xq, xs = quant_per_token_group_fp8(x)
    xs_mm = quant_per_token_group_fp8(x, m_major_scales=True)[1]
    ref = dequant_per_token_group(xq, xs) @ dequant_weight_block(*weights[0]).t()
    calls, reps = max(len(weights), 4), args.replays
    pick = lambda i: weights[i % len(weights)]  # noqa: E731
    row: dict[str, Any] = {"shape": name, "N": n, "K": k, "M": m}
    row["triton"] = _path(lambda i: fp8_block_gemm_triton(xq, xs, *pick(i)), ref, calls, reps)
    if cublas_supported(n, k):
        cublas = lambda i: fp8_block_gemm_cublas(xq, xs_mm, *pick(i))  # noqa: E731
        row["cublas"] = _path(cublas, ref, calls, reps)
    if module is not None and deepgemm.supported(n, k):
        dg = lambda i: deepgemm.deepgemm_gemm(module, xq, xs_mm, *pick(i))  # noqa: E731
        row["deepgemm"] = _path(dg, ref, calls, reps)
    row["baseline"] = choose_backend(m, n, k)
    row["TFLOPs_deepgemm"] = 2 * m * n * k / row.get("deepgemm", {}).get("us", float("inf")) / 1e6
    return row


def measured(row: dict[str, Any], limit: float = ERROR_LIMIT) -> Measured | None:
    """The table point of a row, if DeepGEMM and the baseline both ran and DeepGEMM's
    result was within ``limit`` of the reference."""
    dg, base = row.get("deepgemm", {}), row.get(row["baseline"], {})
    if "us" not in dg or "us" not in base or dg["rel_err"] > limit:
        return None
    key = "M" if "M" in row else "T"
    return Measured(row[key], dg["us"], row["baseline"], base["us"])


def speedup(row: dict[str, Any]) -> float | None:
    point = measured(row, float("inf"))
    return None if point is None else point.speedup


def run_dense(module: ModuleType | None, args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    for name, (n, k) in dense_shapes(args.deepgemm_tp).items():
        if args.deepgemm_shapes and name not in args.deepgemm_shapes:
            continue
        weights = weight_copies(n, k)
        for m in args.deepgemm_ms:
            rows.append(dense_point(module, name, weights, m, args))
            print(_dense_line(rows[-1]), flush=True)
        del weights
        torch.cuda.empty_cache()
    return rows


def dense_table_points(rows: list[dict[str, Any]]) -> dict[str, list[Measured]]:
    out: dict[str, list[Measured]] = {}
    for r in rows:
        point = measured(r)
        if point is not None:
            out.setdefault(dense_key(r["N"], r["K"]), []).append(point)
    return out


def cell(path: dict | None, key: str, spec: str) -> str:
    if not path:
        return "-"
    return format(path[key], spec) if key in path else "fail"


def _dense_line(r: dict[str, Any]) -> str:
    dg, cb, tr = r.get("deepgemm"), r.get("cublas"), r.get("triton")
    s = speedup(r)
    return (
        f"{r['shape']:>28} {r['N']:>6} {r['K']:>6} {r['M']:>5} {cell(dg, 'us', '9.1f'):>9} "
        f"{cell(cb, 'us', '9.1f'):>9} {cell(tr, 'us', '9.1f'):>9} {r['baseline']:>7} "
        f"{'-' if s is None else format(s, '.2f'):>6} {cell(dg, 'rel_err', '.1e'):>8} "
        f"{cell(cb, 'rel_err', '.1e'):>8} {cell(tr, 'rel_err', '.1e'):>8} "
        f"{r['TFLOPs_deepgemm']:>7.0f}"
    )


def print_dense(rows: list[dict[str, Any]]) -> None:
    print("dense FP8 GEMM: DeepGEMM vs cuBLAS (scaled_mm block scaling) vs Triton, us; "
          "speedup = baseline / DeepGEMM; rel_err vs the float32 reference")  # fmt: skip
    print(
        f"{'shape':>28} {'N':>6} {'K':>6} {'M':>5} {'deepgemm':>9} {'cublas':>9} {'triton':>9} "
        f"{'base':>7} {'speed':>6} {'err dg':>8} {'err cb':>8} {'err tr':>8} {'TFLOP/s':>7}"
    )
    for r in rows:
        print(_dense_line(r))
