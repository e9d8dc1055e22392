"""DeepSeek-V3 router: sigmoid scores, bias-corrected group-limited top-k (torch reference)."""

from __future__ import annotations

import torch


def grouped_topk(
    router_logits: torch.Tensor,
    correction_bias: torch.Tensor,
    top_k: int,
    n_group: int,
    topk_group: int,
    routed_scaling_factor: float,
    renormalize: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Select experts per token.

    router_logits [T, E] (float32). Selection ranks ``sigmoid(logits) + bias`` within the
    ``topk_group`` groups whose score (sum of their top-2 biased scores) is highest; the
    weights are the unbiased sigmoid scores of the chosen experts, normalised to sum 1
    (when ``renormalize``) and multiplied by ``routed_scaling_factor``.

    Returns ``(topk_weights [T, k] float32, topk_ids [T, k] int64)``.
    """
    t, e = router_logits.shape
    scores = router_logits.float().sigmoid()
    biased = scores + correction_bias.float()[None, :]
    grouped = biased.view(t, n_group, e // n_group)
    group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
    group_idx = group_scores.topk(topk_group, dim=-1).indices
    group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, group_idx, True)
    expert_mask = group_mask[:, :, None].expand_as(grouped).reshape(t, e)
    topk_ids = biased.masked_fill(~expert_mask, float("-inf")).topk(top_k, dim=-1).indices
    weights = scores.gather(1, topk_ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * routed_scaling_factor, topk_ids
