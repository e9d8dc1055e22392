"""``bench model --profile-graphs``: the device ops of the graphed decode step and of one
graphed draft step at batch size 1, from ``torch.profiler``.

Per step: the top device ops (kernels, copies, memsets) by time per call; their sum per
call (``kernel_ms``) beside the call's wall time (``wall_ms``: CUDA events around the call
as the engine makes it, host padding and planning then the replay, unprofiled median) and
the device span per call (``span_ms``: first op's start to last op's end, profiled).
``wall - span`` is host work before the GPU starts; ``span - kernel`` the gaps between ops.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from dsv3serve.bench.model.batches import context_spans
from dsv3serve.bench.model.host import host_breakdown
from dsv3serve.bench.model.spec_graphs import SpecGraphTimer, median_call_ms
from dsv3serve.engine.model_runner import ModelRunner

CALL_TAG = "bench_call"  # record_function name prefix of one profiled call
TOP_OPS = 15


@dataclass(frozen=True)
class DeviceOp:
    """One op the device ran: name and start / end (microseconds, profiler clock)."""

    name: str
    start_us: float
    end_us: float

    @property
    def us(self) -> float:
        return self.end_us - self.start_us


def _annotation(event: Any) -> bool:
    """A ``record_function`` range (Kineto also mirrors them on the device's timeline)."""
    return bool(getattr(event, "is_user_annotation", False)) or event.name.startswith(CALL_TAG)


def device_ops(events: Iterable[Any]) -> list[DeviceOp]:
    """The device-side ops among ``torch.profiler``'s ``prof.events()`` (no annotations)."""
    cuda = torch.autograd.DeviceType.CUDA
    return [
        DeviceOp(e.name, e.time_range.start, e.time_range.end)
        for e in events
        if e.device_type == cuda and not _annotation(e)
    ]


def call_windows(events: Iterable[Any]) -> list[tuple[float, float]]:
    """(start, end) microseconds of each host-side ``CALL_TAG`` range, in order."""
    cpu = torch.autograd.DeviceType.CPU
    ranges = [e.time_range for e in events if e.device_type == cpu and e.name.startswith(CALL_TAG)]
    return sorted((r.start, r.end) for r in ranges)


def _span_ms(ops: list[DeviceOp], windows: list[tuple[float, float]]) -> float | None:
    """Median over the windows of first op start to last op end (ops starting inside)."""
    spans = []
    for lo, hi in windows:
        inside = [op for op in ops if lo <= op.start_us <= hi]
        if inside:
            spans.append(max(op.end_us for op in inside) - min(op.start_us for op in inside))
    return statistics.median(spans) / 1e3 if spans else None


def summarize_ops(
    ops: list[DeviceOp], windows: list[tuple[float, float]], calls: int, top: int = TOP_OPS
) -> dict[str, Any]:
    """Per call: device op time, op count, span, and the ``top`` ops by total time (each with
    its launches and ms per call and its share of the op time)."""
    total: dict[str, float] = {}
    count: dict[str, int] = {}
    for op in ops:
        total[op.name] = total.get(op.name, 0.0) + op.us
        count[op.name] = count.get(op.name, 0) + 1
    all_us = sum(total.values())
    ranked = sorted(total, key=lambda name: -total[name])[:top]
    return {
        "calls": calls,
        "kernel_ms": all_us / calls / 1e3,
        "ops_per_call": len(ops) / calls,
        "span_ms": _span_ms(ops, windows),
        "top": [
            {
                "name": name,
                "per_call": count[name] / calls,
                "ms": total[name] / calls / 1e3,
                "share": total[name] / all_us,
            }
            for name in ranked
        ],  # fmt: skip
    }


def timeline(ops: list[DeviceOp], window: tuple[float, float]) -> list[list[Any]]:
    """The device ops of one call in launch order: [name, us, gap_us before it]."""
    inside = sorted((op for op in ops if window[0] <= op.start_us <= window[1]),
                    key=lambda op: op.start_us)  # fmt: skip
    rows, last = [], None
    for op in inside:
        gap = 0.0 if last is None else max(0.0, op.start_us - last)
        rows.append([op.name[:120], round(op.us, 2), round(gap, 2)])
        last = op.end_us
    return rows


def profile_call(
    run: Callable[[], Any], warmup: int, iters: int, calls: int = 5, top: int = TOP_OPS
) -> dict[str, Any]:
    """``run``'s wall time (unprofiled median of ``iters``), its device ops (``calls``
    profiled calls, each from an idle device; ``timeline``: the last call's ops in order)
    and where its host time goes (``host``: cProfile)."""
    wall_ms = median_call_ms(run, warmup, iters)
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        for i in range(calls):
            torch.cuda.synchronize()
            with torch.profiler.record_function(f"{CALL_TAG}{i}"):
                run()
                torch.cuda.synchronize()
    events = prof.events()
    ops, windows = device_ops(events), call_windows(events)
    summary = summarize_ops(ops, windows, calls, top)
    summary["timeline"] = timeline(ops, windows[-1]) if windows else []
    summary["host"] = host_breakdown(run)
    return {"wall_ms": wall_ms, "host_ms": wall_ms - summary["kernel_ms"], **summary}


def profile_graphs(
    runner: ModelRunner, context: int, warmup: int, iters: int, num_steps: int = 3
) -> dict[str, Any]:
    """The graphed decode step, one graphed draft step (the one-step chain), the chain of
    ``num_steps - 1`` steps and the verify of ``num_steps + 1`` tokens, for one sequence
    over ``context`` cached tokens; ``skipped`` says why where they cannot run."""
    graphs = runner.graphs
    if graphs is None:
        return {"skipped": "no decode CUDA graphs (they need CUDA and the flashinfer backend)"}
    page, vocab = runner.cfg.page_size, runner.model_cfg.vocab_size
    spans = context_spans(1, context, 1, page, vocab)
    result: dict[str, Any] = {"batch_size": 1, "context": context, "num_steps": num_steps}
    result["decode"] = profile_call(lambda: graphs.run(spans), warmup, iters)
    if runner.model.nextn is None:
        result["draft_step"] = {"skipped": "no NextN layer (--no-mtp)"}
        return result
    timer = SpecGraphTimer(runner, warmup, iters)
    calls: dict[str, Callable[[], Callable[[], object]]] = {
        "draft_step": lambda: timer.chain_call(1, context, 2)[0]
    }
    if num_steps > 2:
        calls["chain"] = lambda: timer.chain_call(1, context, num_steps)[0]
    calls["verify"] = lambda: timer.verify_call(1, context, num_steps)
    for name, make in calls.items():
        try:
            result[name] = profile_call(make(), warmup, iters)
        finally:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
    return result
