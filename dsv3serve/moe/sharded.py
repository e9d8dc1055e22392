"""Routed experts under a parallel layout: which experts (and what width) a rank holds, the
router's ids mapped onto the local stack, and the dispatch -> local experts -> combine path.
"""

from __future__ import annotations

import torch

from dsv3serve.config import ModelConfig
from dsv3serve.moe.base import MoEBackend
from dsv3serve.moe.experts import FusedExperts
from dsv3serve.moe.masked_moe import MaskedRoute, masked_moe
from dsv3serve.parallel.dispatch_base import Dispatcher, MaskedDispatcher
from dsv3serve.parallel.shard import RankLayout, check_split, placement_of
from dsv3serve.parallel.uniform import uniform_real_tokens


def held_experts(
    cfg: ModelConfig, prefix: str, layout: RankLayout | None, fp8: bool
) -> tuple[range, int]:
    """``(global expert ids, intermediate size)`` this rank holds for MoE layer ``prefix``
    (``...mlp``), by :func:`placement_of`; a split off FP8's 128 blocks raises LayoutError."""
    e, inter, h = cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.hidden_size
    if layout is None:
        return range(e), inter
    experts = layout.expert_range(e)
    shapes = {"gate_proj": (inter, h), "down_proj": (h, inter)}
    for proj, shape in shapes.items():
        name = f"{prefix}.experts.{experts.start}.{proj}.weight"
        check_split(name, shape, placement_of(name, layout, e), fp8)
    gate = placement_of(f"{prefix}.experts.{experts.start}.gate_proj.weight", layout, e)
    return experts, gate.local_shape((inter, h))[0]


def to_local_ids(
    weights: torch.Tensor, ids: torch.Tensor, experts: range
) -> tuple[torch.Tensor, torch.Tensor]:
    """Global ids [T, K] -> slots of the stack holding ``experts``; a choice of an expert held
    elsewhere becomes id -1 with weight 0, which the backends skip (:class:`MoEBackend`)."""
    local = ids - experts.start
    held = (local >= 0) & (local < len(experts))
    return torch.where(held, weights, 0.0), torch.where(held, local, -1)


def run_dispatched(
    dispatcher: Dispatcher,
    backend: MoEBackend,
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    experts: FusedExperts,
    decode: bool | None = None,
) -> torch.Tensor:
    """Routed-expert output [T, H] for this rank's tokens ``x`` [T, H] (T may be 0): send
    them to their experts' ranks, run the local experts on what arrived, bring sums back.
    A :class:`MaskedDispatcher` that wants this phase masked takes :func:`run_masked`
    instead; the phase is ``decode``, or when None the group's (``step_is_decode``)."""
    phase = dispatcher.step_is_decode if decode is None else decode
    if isinstance(dispatcher, MaskedDispatcher) and dispatcher.use_masked(phase):
        return run_masked(dispatcher, x, weights, ids, experts)
    sent = dispatcher.dispatch(x, ids, weights)
    if sent.x.shape[0] == 0:
        return dispatcher.combine(sent.x, sent)
    # slots of experts on other ranks arrive as -1, which the backends skip; zero their weights
    local_w = torch.where(sent.topk_ids >= 0, sent.topk_weights, 0.0)
    return dispatcher.combine(backend.forward(sent.x, local_w, sent.topk_ids, experts), sent)


DEEPEP_FUSION_REASON = (
    "shared-expert fusion is off under moe_a2a_backend 'deepep' (SGLang's rule): DeepEP "
    "dispatches routed top-k only, so the shared expert runs beside it on every rank's tokens"
)


def run_masked(
    dispatcher: MaskedDispatcher,
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    experts: FusedExperts,
) -> torch.Tensor:
    """The low-latency path: per-expert masked layout -> masked grouped MoE -> weighted
    combine (fixed shapes, no host sync with the Triton kernel). A batch over the
    dispatcher's ``max_tokens_per_rank`` (a prefill step under ``low_latency``) goes in
    rounds of that many tokens; every rank makes as many rounds as the group's largest
    batch needs (``step_max_tokens``), sending a routed-nowhere row when it has none left."""
    bound = dispatcher.max_tokens_per_rank
    rounds = -(-max(dispatcher.step_max_tokens, x.shape[0], 1) // bound)
    if rounds == 1:  # a graph's padding rows (the uniform batch's tail) are routed nowhere
        real = uniform_real_tokens(x.shape[0])
        return _masked_round(dispatcher, x, weights, ids, experts, real)
    outs = []
    for r in range(rounds):
        part = slice(r * bound, (r + 1) * bound)
        if x[part].shape[0]:
            outs.append(_masked_round(dispatcher, x[part], weights[part], ids[part], experts))
        else:  # this rank is done; the others still send: join with one row sent nowhere
            k = ids.shape[1]
            row, w, none = (
                x.new_zeros(1, x.shape[1]),
                weights.new_zeros(1, k),
                ids.new_full((1, k), -1),
            )
            _masked_round(dispatcher, row, w, none, experts)
    return torch.cat(outs) if outs else x.new_zeros(0, x.shape[1])


def _masked_round(
    dispatcher: MaskedDispatcher,
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    experts: FusedExperts,
    real: torch.Tensor | None = None,
) -> torch.Tensor:
    """One masked dispatch -> MoE -> combine of at most ``max_tokens_per_rank`` tokens (rows
    at or past the device scalar ``real`` are padding, sent nowhere). The
    MoE's tile is the fused MoE's for this step's tokens over the group (every rank's batch
    is about this one's)."""
    sent = dispatcher.dispatch_masked(x, ids, weights, num_tokens=real)
    world = sent.x.shape[1] // dispatcher.max_tokens_per_rank
    route = MaskedRoute(max(x.shape[0], 1) * world, ids.shape[1], experts.num_experts * world)
    y = masked_moe(sent.x, sent.counts, experts.stack(), sent.x_scale, route)
    return dispatcher.combine_masked(y, sent)


def fusion_blocked_reason(layout: RankLayout | None) -> str | None:
    """Why this layout cannot run the shared expert as slot E of the stack (None: it can)."""
    if layout is None:
        return None
    p = layout.parallel
    if p.moe_a2a_backend == "deepep":
        return DEEPEP_FUSION_REASON
    if p.ep_size > 1:
        return f"expected every routed expert on the rank, found ep_size {p.ep_size}"
    if p.attn_tp_size > 1:
        return f"expected a whole shared expert, found it split over {p.attn_tp_size} ranks"
    return None
