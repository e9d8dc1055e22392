"""The one place that turns ``ParallelConfig.moe_a2a_backend`` into a :class:`Dispatcher`."""

from __future__ import annotations

import importlib.util

import torch.distributed as dist

from dsv3serve.parallel.config import LayoutError, ParallelConfig
from dsv3serve.parallel.dispatch_a2a import AllToAllDispatcher
from dsv3serve.parallel.dispatch_base import Dispatcher
from dsv3serve.parallel.dispatch_loopback import LoopbackTimingOnlyDispatcher, NoDispatch
from dsv3serve.parallel.shard import RankLayout


class DispatchBackendUnavailable(LayoutError):
    """The configured dispatch backend cannot run here; the message says why and what to do."""


def deepep_unavailable() -> DispatchBackendUnavailable:
    """The error for ``moe_a2a_backend='deepep'``: why it cannot run, and where to read more."""
    if importlib.util.find_spec("deep_ep") is None:
        why = "the deep_ep package is not installed and the DeepEP backend is not built yet"
    else:
        why = "deep_ep is installed, but the DeepEP backend is not built yet"
    return DispatchBackendUnavailable(
        f"moe_a2a_backend 'deepep': {why} (issue: DeepEP dispatch/combine); see docs/deepep.md "
        "for the status and how DeepEP would be installed. Use moe_a2a_backend 'none' (the "
        "torch.distributed all-to-all) meanwhile."
    )


def create_dispatcher(
    parallel: ParallelConfig,
    num_experts: int,
    rank: int,
    group: dist.ProcessGroup | None = None,
    loopback: bool = False,
) -> Dispatcher:
    """The dispatcher for global rank ``rank`` of ``parallel``'s group.

    ``ep_size`` 1: :class:`NoDispatch`. ``moe_a2a_backend`` ``"none"`` with ``ep_size`` > 1:
    :class:`AllToAllDispatcher` over ``group`` (None: the world, which must have ``ep_size``
    ranks), or with ``loopback`` the one-process :class:`LoopbackTimingOnlyDispatcher` (for
    timing only; no process group needed). ``"deepep"``: refused, see
    :func:`deepep_unavailable`.
    """
    if parallel.moe_a2a_backend == "deepep":
        raise deepep_unavailable()
    if parallel.ep_size == 1:
        return NoDispatch(num_experts)
    ep_rank = RankLayout(parallel, rank).tp_rank(parallel.ep_size)
    if loopback:
        return LoopbackTimingOnlyDispatcher(num_experts, parallel.ep_size, ep_rank)
    return _all_to_all(parallel, num_experts, ep_rank, group)


def _all_to_all(
    parallel: ParallelConfig, num_experts: int, ep_rank: int, group: dist.ProcessGroup | None
) -> AllToAllDispatcher:
    if not dist.is_initialized():
        raise LayoutError(
            f"ep_size {parallel.ep_size} with moe_a2a_backend 'none' needs an initialised "
            "torch.distributed process group (found none)"
        )
    found = (dist.get_world_size(group), dist.get_rank(group))
    if found != (parallel.ep_size, ep_rank):
        raise LayoutError(
            f"expected an expert-parallel group of {parallel.ep_size} ranks in which this is "
            f"rank {ep_rank}, found {found[0]} ranks and rank {found[1]}"
        )
    return AllToAllDispatcher(num_experts, group)
