"""Spawned gloo ranks that run EP steps for the metering and CUDA-graph-style tests.

Every rank runs, on the same cases of :mod:`dispatch_util`:

* ``metered``: two rounds of one case through each backend (all-to-all, DeepEP normal,
  DeepEP low-latency, low-latency FP8) and each dispatcher's meter snapshot afterwards;
* ``graph_style``: DeepEP low-latency steps over *one* set of preallocated input buffers,
  each step a different real token count padded to ``MAX_TOKENS`` with NaN rows routed to
  real experts (they must not be sent), under :class:`HostSyncGuard` -- any host read of a
  tensor in the glue or the meter raises; the fake DeepEP (a stand-in for GPU kernels, which
  syncs over gloo) runs unguarded;
* before those, the meter's switches (:mod:`meter_switch_util`): metering off, a graph
  capture's warm-up, the low-latency pair's work on its counts.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from deepep_util import MAX_TOKENS, make_deepep
from dispatch_util import (
    NUM_EXPERTS,
    TOPK,
    Case,
    flat_round,
    gloo_rank,
    save_rank_results,
    spawn_for_results,
)
from meter_switch_util import metering_off, warm_up_then_round

from dsv3serve.parallel.dispatch_a2a import AllToAllDispatcher
from dsv3serve.parallel.dispatch_deepep import DeepEPDispatcher

SYNC_METHODS = ("item", "tolist", "numpy", "cpu", "nonzero", "__int__", "__float__",
                "__bool__", "__index__")  # fmt: skip


class HostSyncGuard:
    """While active, the tensor methods that read a device value on the host raise, as do
    boolean-mask indexing and ``repeat_interleave`` with tensor repeats (both size their
    output from device data). :meth:`allow` lifts it for a stand-in's own work."""

    def __init__(self) -> None:
        self.depth = 0  # > 0: allowed
        self.saved: dict[str, Any] = {}

    def _wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        guard = self

        def checked(*args: Any, **kwargs: Any) -> Any:
            if guard.depth == 0 and guard.forbidden(name, args, kwargs):
                raise AssertionError(f"host sync on the step path: Tensor.{name}")
            return fn(*args, **kwargs)

        return checked

    @staticmethod
    def forbidden(name: str, args: tuple, kwargs: dict) -> bool:
        if name == "__getitem__":
            index = args[1] if isinstance(args[1], tuple) else (args[1],)
            return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in index)
        if name == "repeat_interleave":
            return isinstance(args[1] if len(args) > 1 else kwargs.get("repeats"), torch.Tensor)
        return True

    @contextmanager
    def active(self) -> Iterator[None]:
        names = (*SYNC_METHODS, "__getitem__", "repeat_interleave")
        for name in names:
            self.saved[name] = getattr(torch.Tensor, name)
            setattr(torch.Tensor, name, self._wrap(name, self.saved[name]))
        try:
            yield
        finally:
            for name in names:
                setattr(torch.Tensor, name, self.saved[name])

    def allow(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def allowed(*args: Any, **kwargs: Any) -> Any:
            self.depth += 1
            try:
                return fn(*args, **kwargs)
            finally:
                self.depth -= 1

        return allowed


def _metered(case: Case, world: int, rank: int) -> dict[str, Any]:
    """Two rounds per backend; low-latency FP8 only where every rank has tokens (the fake's
    FP8 quantiser takes no empty batch)."""
    hidden = case.xs[rank].shape[1]
    ds = {
        "a2a": AllToAllDispatcher(NUM_EXPERTS),
        "normal": make_deepep(world, rank, "normal", hidden),
        "low_latency": make_deepep(world, rank, "low_latency", hidden),
    }
    if min(x.shape[0] for x in case.xs) > 0:
        ds["low_latency_fp8"] = make_deepep(world, rank, "low_latency", hidden, fp8=True)
    for _ in range(2):
        for d in ds.values():
            if isinstance(d, DeepEPDispatcher) and d.mode == "low_latency":
                got = d.dispatch_masked(case.xs[rank], case.ids[rank], case.weights[rank])
                d.combine_masked(got.rows(), got)
            else:
                flat_round(d, case, rank)
    return {name: d.meter.snapshot() for name, d in ds.items()}


def _graph_style(case: Case, world: int, rank: int, steps: list[int]) -> dict[str, Any]:
    """DeepEP low-latency steps over static buffers; per step: output, its data pointers
    and shapes, the counts' sum."""
    d: DeepEPDispatcher = make_deepep(world, rank, "low_latency", case.xs[rank].shape[1])
    guard = HostSyncGuard()
    d.buffer.low_latency_dispatch = guard.allow(d.buffer.low_latency_dispatch)
    d.buffer.low_latency_combine = guard.allow(d.buffer.low_latency_combine)
    x_buf = torch.full((MAX_TOKENS, case.xs[rank].shape[1]), float("nan"), dtype=torch.bfloat16)
    ids_buf = torch.arange(MAX_TOKENS * TOPK).reshape(MAX_TOKENS, TOPK) % NUM_EXPERTS
    w_buf = torch.ones(MAX_TOKENS, TOPK)
    n_buf = torch.zeros((), dtype=torch.int64)
    first = rank * d.num_local_experts
    mats = case.mats[first : first + d.num_local_experts].to(torch.bfloat16)
    out: dict[str, Any] = {"steps": [], "buffers": []}
    for n in steps:
        x_buf.fill_(float("nan"))  # padding: NaN rows, routed to real experts below
        x_buf[:n], ids_buf[:n], w_buf[:n] = (
            case.xs[rank][:n],
            case.ids[rank][:n],
            case.weights[rank][:n],
        )
        n_buf.fill_(n)
        with guard.active():
            got = d.dispatch_masked(x_buf, ids_buf, w_buf, num_tokens=n_buf)
            y = torch.bmm(got.rows(mats.dtype), mats)  # padding slab rows: garbage (never combined)
            combined = d.combine_masked(y, got)
        out["steps"].append((n, combined.clone(), int(got.counts.sum()), tuple(got.x.shape)))
        out["buffers"].append((x_buf.data_ptr(), ids_buf.data_ptr(), tuple(combined.shape)))
    out["meter"] = d.meter.snapshot()
    return out


def _rank_main(rank: int, world: int, workdir: str, steps: list[int]) -> None:
    with gloo_rank(rank, world, workdir) as root:
        cases: list[Case] = torch.load(root / "cases.pt", weights_only=False)
        both_have_tokens = next(c for c in cases if c.name == "uniform")
        results = {"_off": metering_off(both_have_tokens, world, rank)}  # the first meters
        results["_warm_up"] = warm_up_then_round(both_have_tokens, world, rank)
        results |= {c.name: _metered(c, world, rank) for c in cases}
        results["_graph_style"] = _graph_style(cases[0], world, rank, steps)
        modes = ("normal", "low_latency", "auto")
        results["_graph_safe"] = {m: make_deepep(world, rank, m, 128).graph_safe for m in modes}
        save_rank_results(results, root, rank)


def run_step_ranks(cases: list[Case], world: int, workdir: Path, steps: list[int]) -> list[dict]:
    """Every case metered on ``world`` spawned gloo ranks, and the graph-style steps of the
    first case (``steps``: real token counts); returns each rank's results."""
    torch.save(cases, workdir / "cases.pt")
    return spawn_for_results(_rank_main, (world, str(workdir), steps), world, workdir)
