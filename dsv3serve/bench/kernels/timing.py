"""Timing kernels on a GPU: the median call from CUDA-graph replays, and the run's ceilings
(device copy bandwidth, bf16 and per-tensor fp8 GEMM peaks at 8192^3).

Timing: after a warm-up call (which also compiles), a CUDA graph captures a row of calls,
call i using the i-th of several copies of the weights (together over 4x the L2 cache, so each
call reads its weights from device memory, as decode does); the graph is replayed several
times between CUDA events, and the median replay over the number of calls is the time of one
call. Activations stay the same tensor across calls, as in a layer's decode step. The graph
removes the host's launch overhead, which at these sizes would otherwise dominate.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

import torch

from dsv3serve.kernels.fp8_ref import FP8_DTYPE

Call = Callable[[int], Any]  # call i uses weight copy i


def graph_us(fn: Call, calls: int, replays: int) -> float:
    """Median GPU time of one call, from replays of a CUDA graph of ``calls`` calls."""
    for i in range(calls):
        fn(i)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(i)
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(replays):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    del graph
    return statistics.median(times) * 1e3 / calls


def eager_us(fn: Call, calls: int, replays: int) -> float:
    """Median time of one call from rows of eager calls between CUDA events (where
    :func:`graph_us` cannot capture them; the host's launch overhead is then included)."""
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


def _copy_us(nbytes: int, replays: int, per_replay: int = 4) -> float:
    """Eager device-to-device copies between events: captured in a graph, the copy becomes a
    memcpy node, which ran about 20% slower on an H100 than torch's eager copy."""
    src = torch.randn(nbytes // 4, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(replays):
        start.record()
        for _ in range(per_replay):
            dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times) * 1e3 / per_replay


def measure_ceilings(replays: int) -> dict[str, float]:
    """Copy bandwidth (bytes read + written), bf16 and fp8 (per-tensor) GEMM peaks at 8192^3."""
    copy_us = _copy_us(2**30, replays)
    a, b = (torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    bf16_us = graph_us(lambda i: a @ b, 4, replays)
    a8, b8, one = a.to(FP8_DTYPE), b.to(FP8_DTYPE), torch.ones((), device="cuda")
    fp8_us = graph_us(
        lambda i: torch._scaled_mm(a8, b8.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16),
        4,
        replays,
    )
    flops = 2 * 8192**3
    return {
        "copy_TBps": 2 * 2**30 / copy_us / 1e6,
        "bf16_gemm_TFLOPs": flops / bf16_us / 1e6,
        "fp8_gemm_TFLOPs": flops / fp8_us / 1e6,
    }
