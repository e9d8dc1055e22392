"""Single-rank torch reference of what dispatch -> local experts -> combine computes.

Written to be read, not fast: a loop over the experts present. Tests run a multi-rank
dispatch, apply each rank's experts to what arrived (with :func:`local_experts`), combine,
and compare with :func:`moe_reference` over all experts on one rank.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

ExpertsFn = Callable[[int, Tensor], Tensor]
"""``experts_fn(expert_id, rows [N, H]) -> [N, H]``: one expert applied to some rows."""


def moe_reference(
    x: Tensor, topk_ids: Tensor, topk_weights: Tensor, experts_fn: ExpertsFn
) -> Tensor:
    """``out[t] = sum_k topk_weights[t, k] * experts_fn(topk_ids[t, k], x[t])`` in float32.

    ``x`` [T, H], ``topk_ids`` [T, K] (``< 0``: the slot is skipped), ``topk_weights`` [T, K].
    Returns [T, H] float32.
    """
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for expert in topk_ids[topk_ids >= 0].unique().tolist():
        token, slot = (topk_ids == expert).nonzero(as_tuple=True)
        w = topk_weights[token, slot].float()[:, None]
        out.index_add_(0, token, w * experts_fn(expert, x[token]).float())
    return out


def local_experts(experts_fn: ExpertsFn, first_expert: int) -> ExpertsFn:
    """``experts_fn`` addressed by local id: local expert ``i`` is global ``first_expert + i``."""
    return lambda expert, rows: experts_fn(first_expert + expert, rows)


def restrict_to_rank(topk_ids: Tensor, num_local_experts: int, rank: int) -> Tensor:
    """``topk_ids`` with every expert outside ``rank``'s range replaced by ``-1``."""
    first = rank * num_local_experts
    mine = (topk_ids >= first) & (topk_ids < first + num_local_experts)
    return torch.where(mine, topk_ids, -1)
