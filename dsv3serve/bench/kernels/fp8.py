"""``dsv3serve bench kernels --only fp8``: per-token-group FP8 quant and the FP8 block GEMM
(Triton, its config sweep, cuBLAS block scaling) on DeepSeek-V3's linear shapes, against the
run's ceilings (timed as :mod:`dsv3serve.bench.kernels.timing` says).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from typing import Any

import torch

from dsv3serve.bench.kernels.timing import graph_us
from dsv3serve.kernels.fp8_gemm import (
    GemmConfig,
    choose_backend,
    fp8_block_gemm_cublas,
    fp8_block_gemm_triton,
    num_sms,
    pick_config,
)
from dsv3serve.kernels.fp8_quant import quant_per_token_group_fp8
from dsv3serve.kernels.fp8_ref import quant_weight_block

SHAPES: dict[str, tuple[int, int]] = {  # name: (N, K)
    "qkv_a": (2112, 7168),
    "q_b": (24576, 1536),
    "kv_b": (32768, 512),
    "o_proj": (7168, 16384),
    "gate_up": (36864, 7168),
    "down": (7168, 18432),
}
DEFAULT_MS = (1, 16, 64, 128, 256, 1024, 4096, 8192)
SWEEP_MAX_M = 256


def _sweep(base: GemmConfig) -> list[GemmConfig]:
    splits = sorted({base.split_k, 2 * base.split_k, max(1, base.split_k // 2)})
    return [
        GemmConfig(base.block_m, bn, s, base.num_warps, stages, swap)
        for swap in (False, True)
        for bn in (64, 128)
        for stages in (3, 5)
        for s in splits
    ]


def _best_config(time_us: Callable[[GemmConfig], float], base: GemmConfig) -> tuple[float, dict]:
    best: tuple[float, dict] = (float("inf"), vars(base))
    for cfg in _sweep(base):
        try:
            t = time_us(cfg)
        except Exception:  # a config over the shared-memory limit: skip it
            continue
        best = min(best, (t, vars(cfg)), key=lambda b: b[0])
    return best


def _path_stats(t_us: float, flops: int, w_bytes: int, io_bytes: int, ceil: dict) -> dict:
    s = t_us / 1e6
    return {
        "us": t_us,
        "TFLOPs": flops / s / 1e12,
        "weight_TBps": w_bytes / s / 1e12,
        "pct_copy_bw": 100 * io_bytes / s / 1e12 / ceil["copy_TBps"],
        "pct_fp8_peak": 100 * flops / s / 1e12 / ceil["fp8_gemm_TFLOPs"],
    }


def _try(time_us: Callable[[], float]) -> tuple[float | None, str | None]:
    try:
        return time_us(), None
    except Exception as err:  # unsupported shape or layout: recorded, not fatal
        return None, f"{type(err).__name__}: {str(err)[:200]}"


def bench_point(
    name: str,
    weights: list[tuple[torch.Tensor, torch.Tensor]],
    m: int,
    ceil: dict,
    args: argparse.Namespace,
) -> dict[str, Any]:
    """Quant, Triton GEMM (picked config, and the best of a sweep for small M), cuBLAS GEMM."""
    n, k = weights[0][0].shape
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    xq, xs = quant_per_token_group_fp8(x)
    xs_mm = quant_per_token_group_fp8(x, m_major_scales=True)[1]
    calls, reps = max(len(weights), 4), args.replays
    flops, w_bytes = 2 * m * n * k, n * k + weights[0][1].numel() * 4
    io_bytes = w_bytes + m * k + xs.numel() * 4 + m * n * 2

    def triton_us(cfg: GemmConfig) -> float:
        def run(i: int) -> torch.Tensor:
            w, ws = weights[i % len(weights)]
            return fp8_block_gemm_triton(xq, xs, w, ws, config=cfg)

        return graph_us(run, calls, reps)

    quant_us = graph_us(lambda i: quant_per_token_group_fp8(x), 4, reps)
    cfg = pick_config(m, n, k, num_sms(torch.cuda.current_device()))
    row: dict[str, Any] = {"shape": name, "N": n, "K": k, "M": m, "config": vars(cfg)}
    quant_TBps = m * k * 3 / quant_us / 1e6  # bf16 read, e4m3 written
    row["quant"] = {"us": quant_us, "pct_copy_bw": 100 * quant_TBps / ceil["copy_TBps"]}
    row["triton"] = _path_stats(triton_us(cfg), flops, w_bytes, io_bytes, ceil)
    if not args.no_sweep and m <= SWEEP_MAX_M:
        best_us, best = _best_config(triton_us, cfg)
        row["triton_best"] = _path_stats(best_us, flops, w_bytes, io_bytes, ceil) | {"config": best}
    cublas = lambda i: fp8_block_gemm_cublas(xq, xs_mm, *weights[i % len(weights)])  # noqa: E731
    cublas_us, err = _try(lambda: graph_us(cublas, calls, reps))
    row["cublas"] = (
        {"error": err}
        if cublas_us is None
        else _path_stats(cublas_us, flops, w_bytes, io_bytes, ceil)
    )
    row["dispatch"] = choose_backend(m, n, k)
    return row


def crossover(rows: list[dict]) -> dict[str, int | None]:
    """Per shape, the smallest M at which cuBLAS beat every Triton config timed."""
    out: dict[str, int | None] = {}
    for r in rows:
        out.setdefault(r["shape"], None)
        triton_us = min(r["triton"]["us"], r.get("triton_best", {}).get("us", float("inf")))
        if out[r["shape"]] is None and r["cublas"].get("us", float("inf")) < triton_us:
            out[r["shape"]] = r["M"]
    return out


def _fmt(stats: dict, key: str, spec: str) -> str:
    return format(stats[key], spec) if key in stats else "-"


def print_table(ceil: dict, rows: list[dict]) -> None:
    print(
        f"ceilings: copy {ceil['copy_TBps']:.2f} TB/s, bf16 {ceil['bf16_gemm_TFLOPs']:.0f} "
        f"TFLOP/s, fp8 {ceil['fp8_gemm_TFLOPs']:.0f} TFLOP/s"
    )
    print(
        f"{'shape':>8} {'M':>5} {'quant us':>8} {'triton us':>9} {'%copy':>6} {'TFLOP/s':>8} "
        f"{'%fp8':>5} {'best us':>8} {'%copy':>6} {'cublas us':>9} {'%copy':>6} {'TFLOP/s':>8} "
        f"{'%fp8':>5} {'auto':>6}"
    )
    for r in rows:
        t, b, c = r["triton"], r.get("triton_best", {}), r["cublas"]
        print(
            f"{r['shape']:>8} {r['M']:>5} {r['quant']['us']:>8.1f} {t['us']:>9.1f} "
            f"{t['pct_copy_bw']:>6.1f} {t['TFLOPs']:>8.1f} {t['pct_fp8_peak']:>5.1f} "
            f"{_fmt(b, 'us', '8.1f'):>8} {_fmt(b, 'pct_copy_bw', '6.1f'):>6} "
            f"{_fmt(c, 'us', '9.1f'):>9} {_fmt(c, 'pct_copy_bw', '6.1f'):>6} "
            f"{_fmt(c, 'TFLOPs', '8.1f'):>8} {_fmt(c, 'pct_fp8_peak', '5.1f'):>5} "
            f"{r['dispatch']:>6}"
        )


def weight_copies(n: int, k: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Enough copies of one random block-quantised weight to fill 4x the L2 cache (<= 16)."""
    w, ws = quant_weight_block(torch.randn(n, k, device="cuda") * 0.02)
    l2 = torch.cuda.get_device_properties(torch.cuda.current_device()).L2_cache_size
    copies = min(16, max(1, -(-4 * l2 // (n * k))))
    return [(w, ws)] + [(w.clone(), ws.clone()) for _ in range(copies - 1)]


def run_fp8(ceil: dict, args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    for name in args.shapes:
        weights = weight_copies(*SHAPES[name])
        for m in args.m:
            rows.append(bench_point(name, weights, m, ceil, args))
            print(json.dumps({k: rows[-1][k] for k in ("shape", "M", "dispatch")}), flush=True)
    return rows
