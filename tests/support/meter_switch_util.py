"""What a spawned EP rank of :mod:`ep_step_util` runs for the meter's switches: metering
off (through the factory and through the engine config), the warm-up before a graph
capture, and the work a low-latency pair does on its per-expert counts.

Counts work is seen by :class:`CountsWatch`, a ``TorchDispatchMode`` that records every
aten op whose arguments share storage with the counts tensor the (fake) DeepEP returned;
the fake's own work on it, before it returns, is not watched.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from deepep_util import make_deepep
from dispatch_util import NUM_EXPERTS, Case, flat_round
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from dsv3serve.config import ModelConfig
from dsv3serve.engine.config import EngineConfig
from dsv3serve.engine.graph_capture import warm_up
from dsv3serve.engine.group.rank_parts import rank_parts
from dsv3serve.model.presets import PRESETS
from dsv3serve.parallel.config import ParallelConfig
from dsv3serve.parallel.dispatch import create_dispatcher
from dsv3serve.parallel.dispatch_base import Dispatcher
from dsv3serve.parallel.dispatch_deepep import DeepEPDispatcher
from dsv3serve.parallel.dispatch_meter import process_snapshots


class CountsWatch(TorchDispatchMode):
    """While active, the names of the aten ops that touch the watched counts tensor (set by
    the wrapped ``low_latency_dispatch`` as it returns), by phase."""

    def __init__(self, d: DeepEPDispatcher) -> None:
        super().__init__()
        self.storage: int | None = None
        self.phase = "dispatch"
        self.ops: dict[str, list[str]] = {"dispatch": [], "combine": []}
        inner = d.buffer.low_latency_dispatch

        def watched(*args: Any, **kwargs: Any) -> Any:
            out = inner(*args, **kwargs)
            self.storage = out[1].untyped_storage().data_ptr()
            return out

        d.buffer.low_latency_dispatch = watched

    def __torch_dispatch__(self, func, types, args=(), kwargs=None) -> Any:  # noqa: ANN001
        kwargs = kwargs or {}
        leaves = tree_leaves((args, kwargs))
        if self.storage is not None and any(_shares(t, self.storage) for t in leaves):
            self.ops[self.phase].append(str(func))
        return func(*args, **kwargs)


def _shares(t: object, storage: int) -> bool:
    return isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() == storage


def _masked_round(d: DeepEPDispatcher, case: Case, rank: int) -> dict[str, list[str]]:
    """One low-latency pair of ``case`` (identity experts); the ops on the counts."""
    watch = CountsWatch(d)
    with watch:
        got = d.dispatch_masked(case.xs[rank], case.ids[rank], case.weights[rank])
        watch.phase = "combine"
        d.combine_masked(got.rows(), got)
    return watch.ops


def _round(d: Dispatcher, case: Case, rank: int) -> Callable[[], object]:
    if isinstance(d, DeepEPDispatcher) and d.mode == "low_latency":
        return lambda: _masked_round(d, case, rank)
    return lambda: flat_round(d, case, rank)


def _dispatchers(world: int, rank: int, hidden: int, metered: bool) -> dict[str, Dispatcher]:
    a2a = ParallelConfig(tp_size=world, dp_size=world, enable_dp_attention=True, ep_size=world)
    return {
        "a2a": create_dispatcher(a2a, NUM_EXPERTS, rank, metered=metered),
        "normal": make_deepep(world, rank, "normal", hidden, metered=metered),
        "low_latency": make_deepep(world, rank, "low_latency", hidden, metered=metered),
    }


def metering_off(case: Case, world: int, rank: int) -> dict[str, Any]:
    """Factory dispatchers made with ``metered=False``, one round each: their snapshots,
    the process's listed meters (none: these are the first the process makes), the ops
    on the low-latency counts; and the engine config's switch through ``rank_parts``."""
    ds = _dispatchers(world, rank, case.xs[rank].shape[1], metered=False)
    ops = {name: _round(d, case, rank)() for name, d in ds.items()}
    out = {
        "snapshots": {name: d.meter.snapshot() for name, d in ds.items()},
        "listed": process_snapshots(),
        "counts_ops": ops["low_latency"],
    }
    out["engine_switch"] = {off: _engine_meter_enabled(world, off) for off in (True, False)}
    return out


def _engine_meter_enabled(world: int, off: bool) -> bool:
    """Whether ``rank_parts`` gives a DP + EP group's dispatcher a recording meter when
    ``disable_moe_dispatch_metrics`` is ``off``."""
    cfg = EngineConfig(
        model="tiny", tp_size=world, dp_size=world, enable_dp_attention=True, ep_size=world,
        disable_moe_dispatch_metrics=off,
    )  # fmt: skip
    parts = rank_parts(cfg, ModelConfig.from_dict(PRESETS["deepseek-v3"]))
    assert parts.dispatcher is not None and parts.dispatcher.meter is not None
    return parts.dispatcher.meter.enabled


def warm_up_then_round(case: Case, world: int, rank: int) -> dict[str, Any]:
    """Metered dispatchers: a graph capture's warm-up (two rounds), then one round; the
    snapshots and the ops on the low-latency counts of the metered round."""
    ds = _dispatchers(world, rank, case.xs[rank].shape[1], metered=True)
    for d in ds.values():
        warm_up(_round(d, case, rank))
    ops = {name: _round(d, case, rank)() for name, d in ds.items()}
    return {
        "snapshots": {name: d.meter.snapshot() for name, d in ds.items()},
        "counts_ops": ops["low_latency"],
    }
