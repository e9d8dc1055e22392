"""The one place that turns ``ParallelConfig.moe_a2a_backend`` into a :class:`Dispatcher`."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from types import ModuleType

import torch
import torch.distributed as dist

from dsv3serve.kernels.fp8_ref import FP8_DTYPE
from dsv3serve.parallel.config import LayoutError, ParallelConfig
from dsv3serve.parallel.deepep_check import (
    DispatchBackendUnavailable,  # noqa: F401 (re-exported: callers catch it from here)
    import_deep_ep,
    self_check,
)
from dsv3serve.parallel.dispatch_a2a import AllToAllDispatcher
from dsv3serve.parallel.dispatch_base import Dispatcher
from dsv3serve.parallel.dispatch_deepep import DeepEPDispatcher, DeepEPShape
from dsv3serve.parallel.dispatch_loopback import LoopbackTimingOnlyDispatcher, NoDispatch
from dsv3serve.parallel.dispatch_meter import unmetered
from dsv3serve.parallel.shard import RankLayout

logger = logging.getLogger(__name__)
DEEPEP_FUSION_NOTE = "shared-expert fusion is off under DeepEP (SGLang's rule)"


@dataclass(frozen=True)
class DeepEPOptions:
    """What the DeepEP backend needs beyond :class:`ParallelConfig`: the model's ``hidden``
    size, the most tokens a rank sends in one low-latency dispatch (the decode batch bound,
    same on every rank), FP8 dispatch, the device of the self-check's tensors, and the
    ``deep_ep`` module (None: import the installed one; tests pass ``fake_deep_ep``)."""

    hidden: int
    max_tokens_per_rank: int = 128
    fp8_dispatch: bool = False
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    module: ModuleType | None = None


def create_dispatcher(
    parallel: ParallelConfig,
    num_experts: int,
    rank: int,
    group: dist.ProcessGroup | None = None,
    loopback: bool = False,
    deepep: DeepEPOptions | None = None,
    metered: bool = True,
) -> Dispatcher:
    """The dispatcher for global rank ``rank`` of ``parallel``'s group.

    ``ep_size`` 1: :class:`NoDispatch`. ``moe_a2a_backend`` ``"none"`` with ``ep_size`` > 1:
    :class:`AllToAllDispatcher` over ``group`` (None: the world, which must have ``ep_size``
    ranks), or with ``loopback`` the one-process :class:`LoopbackTimingOnlyDispatcher` (for
    timing only; no process group needed). ``"deepep"``: :class:`DeepEPDispatcher` in
    ``parallel.deepep_mode`` over ``group``, sized by ``deepep`` (required), after
    ``deep_ep`` imported and passed its self-check (else :class:`DispatchBackendUnavailable`).
    ``metered``: whether the dispatcher's meter records its calls (the engine's
    ``disable_moe_dispatch_metrics`` turns it off).
    """
    if parallel.ep_size == 1:
        return NoDispatch(num_experts)
    ep_rank = RankLayout(parallel, rank).tp_rank(parallel.ep_size)
    deep_ep = _deep_ep_module(parallel, loopback, deepep)
    if loopback:
        return LoopbackTimingOnlyDispatcher(num_experts, parallel.ep_size, ep_rank)
    _check_group(parallel, ep_rank, group)
    if deep_ep is not None and deepep is not None:  # _deep_ep_module checked deepep
        return _deepep(deep_ep, parallel, num_experts, group, deepep, metered)
    return AllToAllDispatcher(num_experts, group, metered=metered)


def _deep_ep_module(
    parallel: ParallelConfig, loopback: bool, options: DeepEPOptions | None
) -> ModuleType | None:
    """The ``deep_ep`` module when the config asks for DeepEP (None otherwise), checked
    before any process group is needed so a missing install is reported first."""
    if parallel.moe_a2a_backend != "deepep":
        return None
    if loopback:
        raise LayoutError(
            "loopback timing runs the all-to-all only; found moe_a2a_backend 'deepep'"
        )
    if options is None:
        raise LayoutError("moe_a2a_backend 'deepep' needs DeepEPOptions (hidden size, ...)")
    return options.module if options.module is not None else import_deep_ep()


def _deepep(
    module: ModuleType,
    parallel: ParallelConfig,
    num_experts: int,
    group: dist.ProcessGroup | None,
    options: DeepEPOptions,
    metered: bool,
) -> DeepEPDispatcher:
    shape = DeepEPShape(num_experts, options.hidden, options.max_tokens_per_rank)
    payload = FP8_DTYPE if options.fp8_dispatch else None
    d = DeepEPDispatcher(module, shape, parallel.deepep_mode, group, payload, metered)
    with unmetered():  # the self-check's round trips are not traffic
        self_check(d, options.device)
    logger.info("DeepEP (%s mode) passed its self-check; %s", d.mode, DEEPEP_FUSION_NOTE)
    return d


def _check_group(parallel: ParallelConfig, ep_rank: int, group: dist.ProcessGroup | None) -> None:
    if not dist.is_initialized():
        raise LayoutError(
            f"ep_size {parallel.ep_size} with moe_a2a_backend {parallel.moe_a2a_backend!r} "
            "needs an initialised torch.distributed process group (found none)"
        )
    found = (dist.get_world_size(group), dist.get_rank(group))
    if found != (parallel.ep_size, ep_rank):
        raise LayoutError(
            f"expected an expert-parallel group of {parallel.ep_size} ranks in which this is "
            f"rank {ep_rank}, found {found[0]} ranks and rank {found[1]}"
        )
