"""``bench group --profile-steps N``: where a group's decode and prefill steps go on rank 0
(issue 35).

Rank 0 runs in the bench's own process, so ``torch.profiler`` there sees rank 0's device ops:
its kernels, copies and the collectives it waits in. ``N`` engine steps of each decode batch,
and ``N`` prefill steps as full as the timed prefill's, are profiled, each from an idle
device; per step this gives

- ``wall_ms``: the step as the engine makes it (host planning, launches or graph replay, the
  collectives, the sampled tokens' copy back), profiled, so a little slower than unprofiled;
- ``span_ms``: first device op's start to last one's end; ``wall - span`` is host time with
  the device idle (before the first op and after the last);
- ``kernel_ms``: the device ops' summed time; ``span - kernel`` is gaps between ops;
- ``categories_ms``: ``kernel_ms`` split by what the op is (:func:`category`). A collective's
  time includes waiting for the slowest rank, so it holds the ranks' imbalance too.
"""

from __future__ import annotations

import re
import statistics
import time
from collections.abc import Callable, Iterable
from contextlib import nullcontext
from typing import Any

import torch

from dsv3serve.bench.model.profile import (
    CALL_TAG,
    DeviceOp,
    call_windows,
    device_ops,
    summarize_ops,
)

# First match wins: collectives before MoE (DeepEP's dispatch and combine are collectives),
# grouped expert GEMMs before plain GEMMs, flashinfer's sampling before its attention.
_EXPERTS = r"_gate_up_body|_down_body|_combine_body|fused_moe|m_grouped"
_ROUTING = r"_count_body|_plan_body|_scatter_body|_grouped_topk_body|_sigmoid_body|moe_align"
CATEGORY_PATTERNS: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("collective", re.compile(r"nccl|deep_ep", re.I)),
    ("moe_experts", re.compile(_EXPERTS, re.I)),
    ("moe_routing", re.compile(_ROUTING, re.I)),
    ("sampling", re.compile(r"sampling|argmax", re.I)),
    ("attention", re.compile(r"flashinfer|mla|_stage1_kernel|_merge_kernel|attention", re.I)),
    ("gemm", re.compile(r"nvjet|cublas|gemm|gemv|cutlass|xmma|_splitk_reduce_body|matmul", re.I)),
    ("norm_rope_quant", re.compile(r"norm|rope|quant", re.I)),
    ("copy", re.compile(r"^memcpy|^memset", re.I)),
)
OTHER = "other"
TOP_OPS = 12


def category(name: str) -> str:
    """What a device op is, from its kernel name (:data:`CATEGORY_PATTERNS`, else ``other``)."""
    for label, pattern in CATEGORY_PATTERNS:
        if pattern.search(name):
            return label
    return OTHER


def by_category(ops: Iterable[DeviceOp], calls: int) -> dict[str, float]:
    """Device time per call (ms) of each category, largest first; categories with no op
    are left out."""
    total: dict[str, float] = {}
    for op in ops:
        label = category(op.name)
        total[label] = total.get(label, 0.0) + op.us
    ranked = sorted(total.items(), key=lambda kv: -kv[1])
    return {label: round(us / calls / 1e3, 4) for label, us in ranked}


def profile_steps(step: Callable[[], int], calls: int) -> dict[str, Any]:
    """Profile ``calls`` calls of ``step`` (an engine step of a running batch, returning the
    tokens it emitted) on this process's GPU. ``tokens_per_step``: what each call emitted (a
    batch still decoding emits one per sequence). Without CUDA the steps run unprofiled and
    the device part says why it is missing."""
    cuda = torch.cuda.is_available()
    walls, tokens = [], []
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) if cuda else nullcontext() as prof:
        for i in range(calls):
            _sync(cuda)
            start = time.perf_counter()
            with torch.profiler.record_function(f"{CALL_TAG}{i}"):
                tokens.append(step())
                _sync(cuda)
            walls.append(time.perf_counter() - start)
    head = {"wall_ms": round(statistics.median(walls) * 1e3, 3), "tokens_per_step": tokens}
    if prof is None:
        return head | {"calls": calls, "skipped": "CUDA only: the profile is of device ops"}
    events = prof.events()
    ops, windows = device_ops(events), call_windows(events)
    summary = summarize_ops(ops, windows, calls, TOP_OPS)
    span = summary["span_ms"]
    host = None if span is None else round(head["wall_ms"] - span, 3)
    return head | {"host_idle_ms": host, **summary, "categories_ms": by_category(ops, calls)}


def _sync(cuda: bool) -> None:
    if cuda:
        torch.cuda.synchronize()


def profile_line(p: dict[str, Any]) -> str:
    """One printed line of a step profile."""
    head = f"  profile (rank 0, ms per step, {p['calls']} steps): wall {p['wall_ms']:.2f}"
    if "skipped" in p:
        return f"{head}; device ops skipped: {p['skipped']}"
    cats = ", ".join(f"{k} {v:.2f}" for k, v in p["categories_ms"].items())
    span = "-" if p["span_ms"] is None else f"{p['span_ms']:.2f}"
    ops = f"kernels {p['kernel_ms']:.2f} in {p['ops_per_call']:.0f} ops"
    return f"{head}, device span {span}, {ops}: {cats}"
