"""Whether DeepEP can serve here: import ``deep_ep``, then one round trip against all-to-all.

``moe_a2a_backend: deepep`` is used only when ``deep_ep`` imports and a dispatch / combine
round trip on random tokens (every mode the dispatcher will use) gives what the
torch.distributed all-to-all gives on the same tokens and toy experts. Otherwise the config
is refused with :class:`DispatchBackendUnavailable`, saying why and how to install DeepEP.
Every rank of the group runs the check and they agree on the verdict (one ``all_reduce``).
"""

from __future__ import annotations

import importlib
from types import ModuleType

import torch
import torch.distributed as dist
from torch import Tensor

from dsv3serve.parallel.config import LayoutError
from dsv3serve.parallel.dispatch_a2a import AllToAllDispatcher
from dsv3serve.parallel.dispatch_deepep import DeepEPDispatcher

INSTALL_HINT = (
    "DeepEP has no official wheel: build one on a GPU machine with benchmarks/deepep/build.sh "
    "(upstream DeepEP source + NVSHMEM from the nvidia-nvshmem-cu13 wheel) and pip install "
    "it; see docs/deepep.md. Or use moe_a2a_backend 'none' (the torch.distributed all-to-all)"
)
CHECK_TOKENS = 8
CHECK_TOPK = 4
RTOL = {False: 2e-2, True: 0.15}  # bf16 rows; e4m3 rows (3 mantissa bits) with fp8 dispatch


class DispatchBackendUnavailable(LayoutError):
    """The configured dispatch backend cannot run here; the message says why and what to do."""


def import_deep_ep() -> ModuleType:
    """The ``deep_ep`` module, or the refusal saying why it did not import."""
    try:
        return importlib.import_module("deep_ep")
    except Exception as e:  # ImportError, or DeepEP's own init asserts (NCCL, CUDA_HOME)
        raise DispatchBackendUnavailable(
            f"moe_a2a_backend 'deepep': deep_ep does not import ({type(e).__name__}: {e}). "
            f"{INSTALL_HINT}"
        ) from e


def _toy_expert_scale(global_ids: Tensor, num_experts: int) -> Tensor:
    """The self-check's expert ``e``: multiply the row by ``1 + e / num_experts``."""
    return 1.0 + global_ids.float() / num_experts


def _check_inputs(d: DeepEPDispatcher, rank: int, device: torch.device) -> tuple[Tensor, ...]:
    g = torch.Generator().manual_seed(1234 + rank)
    t = min(CHECK_TOKENS, d.max_tokens_per_rank)
    x = torch.randn(t, d.shape.hidden, generator=g).to(torch.bfloat16)
    k = min(CHECK_TOPK, d.shape.num_experts)
    ids = torch.rand(t, d.shape.num_experts, generator=g).topk(k, dim=1).indices
    w = torch.rand(t, k, generator=g)
    return x.to(device), ids.to(device), w.to(device)


def _flat_round_trip(
    d: AllToAllDispatcher | DeepEPDispatcher, x: Tensor, ids: Tensor, w: Tensor, rank: int
) -> Tensor:
    """dispatch -> sum_k w * scale(e) * row -> combine, through any flat dispatcher."""
    got = d.dispatch(x, ids, w)
    valid = got.topk_ids >= 0
    num_experts = d.num_local_experts * dist.get_world_size(d.group)
    scale = _toy_expert_scale(got.topk_ids + rank * d.num_local_experts, num_experts)
    per_row = (torch.where(valid, got.topk_weights, 0.0) * scale).sum(1, keepdim=True)
    return d.combine((got.x.float() * per_row).to(got.x.dtype), got).float()


def _masked_round_trip(d: DeepEPDispatcher, x: Tensor, ids: Tensor, w: Tensor) -> Tensor:
    got = d.dispatch_masked(x, ids, w)
    first = d.rank * d.num_local_experts
    local = torch.arange(d.num_local_experts, device=x.device)
    scale = _toy_expert_scale(local + first, d.shape.num_experts)[:, None, None]
    return d.combine_masked((got.rows(torch.float32) * scale).to(torch.bfloat16), got).float()


def _error(got: Tensor, want: Tensor, rtol: float) -> float:
    """Largest deviation in units of the tolerance (> 1: fail); NaN counts as a failure."""
    dev = (got - want).abs() / (rtol * (want.abs() + 1.0))
    return float(torch.nan_to_num(dev, nan=float("inf")).max()) if dev.numel() else 0.0


def self_check(d: DeepEPDispatcher, device: torch.device) -> None:
    """One round trip per mode ``d`` uses, against :class:`AllToAllDispatcher`; raises
    :class:`DispatchBackendUnavailable` on every rank if any rank saw a mismatch."""
    reference = AllToAllDispatcher(d.shape.num_experts, d.group)
    x, ids, w = _check_inputs(d, d.rank, device)
    want = _flat_round_trip(reference, x, ids, w, d.rank)
    errors = {}
    if d.mode != "low_latency":
        errors["normal"] = _error(_flat_round_trip(d, x, ids, w, d.rank), want, RTOL[d.fp8])
    if d.mode != "normal":
        errors["low_latency"] = _error(_masked_round_trip(d, x, ids, w), want, RTOL[d.fp8])
    _agree_or_refuse(errors, d, device)


def _agree_or_refuse(errors: dict[str, float], d: DeepEPDispatcher, device: torch.device) -> None:
    worst = torch.tensor(list(errors.values()), dtype=torch.float64, device=device)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX, group=d.group)
    bad = [m for m, e in zip(errors, worst.tolist(), strict=True) if not e <= 1.0]
    if bad:
        shown = ", ".join(
            f"{m}: {e:.3g}x the tolerance" for m, e in zip(errors, worst.tolist(), strict=True)
        )
        raise DispatchBackendUnavailable(
            f"moe_a2a_backend 'deepep': {getattr(d.ep, '__name__', 'deep_ep')} imports but its "
            f"self-check failed ({', '.join(bad)} mode round trip differs from the "
            f"torch.distributed all-to-all on the same tokens; worst over ranks: {shown}). "
            f"The installed DeepEP does not match this GPU / driver / torch. {INSTALL_HINT}"
        )
