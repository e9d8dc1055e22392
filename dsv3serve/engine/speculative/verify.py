"""Lossless verification of chain drafts: pure functions on the target's outputs.

Layout: ``B`` sequences, each verifying up to ``K`` draft tokens in one target forward
over ``K + 1`` positions. Row ``b`` holds ``num_drafts[b] <= K`` drafts; entries past it
are padding and never read as drafts. Position ``j`` carries the target's next-token
choice after the decode token and drafts ``1..j`` (position 0: after the decode token).

Both functions return ``(num_accepted [B] int64, tokens [B, K + 1] int64)``: the round
commits ``tokens[b, : num_accepted[b] + 1]``, the accepted drafts then one token chosen
by the target (the correction at the first rejected draft, or the bonus after them all).
Randomness comes in as arguments, so the functions are deterministic given their inputs.
"""

from __future__ import annotations

import torch
from torch import Tensor


def accepted_prefix(accept: Tensor, num_drafts: Tensor) -> Tensor:
    """Length [B] of the leading run of True in ``accept`` [B, K], capped at ``num_drafts``."""
    positions = torch.arange(accept.shape[1], device=accept.device)
    valid = positions < num_drafts.unsqueeze(1)
    return (accept & valid).long().cumprod(dim=1).sum(dim=1)


def greedy_verify(
    target_ids: Tensor, draft_ids: Tensor, num_drafts: Tensor
) -> tuple[Tensor, Tensor]:
    """Greedy target: accept the longest draft prefix equal to the target's own argmax.

    ``target_ids`` [B, K + 1] is the target's argmax at every position, ``draft_ids``
    [B, K] the drafts. Accepted drafts equal the target's tokens, so ``target_ids`` is
    also the committed row: the output is token-for-token what greedy decoding without
    speculation gives.
    """
    k = draft_ids.shape[1]
    num_accepted = accepted_prefix(draft_ids == target_ids[:, :k], num_drafts)
    return num_accepted, target_ids


def rejection_verify(
    target_probs: Tensor,
    draft_ids: Tensor,
    num_drafts: Tensor,
    uniforms: Tensor,
    noise: Tensor,
    draft_probs: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Speculative sampling (Leviathan et al.; Chen et al.): the target's distribution, exactly.

    ``target_probs`` [B, K + 1, V]: the target's sampling distribution ``p_j`` at each
    position (after penalties, temperature and top-k / top-p / min-p; rows sum to 1).
    ``draft_probs`` [B, K, V]: the draft's ``q_j``, or None for a deterministic draft
    (``q_j`` one-hot at the draft token). Draft ``x = d_j`` is accepted, if all before it
    were, when ``uniforms[b, j] * q_j(x) < p_j(x)`` (probability ``min(1, p/q)``). At the
    first rejected ``j`` the target token is drawn from ``norm(max(p_j - q_j, 0))``, after
    all accepted from ``p_{num_drafts}``, by the exponential race ``argmax(w / noise)``.

    ``uniforms`` [B, K] are U[0, 1) draws; ``noise`` [B, V] i.i.d. Exp(1) draws (> 0).
    """
    b, k = draft_ids.shape
    rows = torch.arange(b, device=draft_ids.device)
    if k == 0:
        num_accepted = torch.zeros(b, dtype=torch.long, device=draft_ids.device)
        return num_accepted, (target_probs[:, 0] / noise).argmax(-1, keepdim=True)
    p_draft = target_probs[:, :k].gather(2, draft_ids.unsqueeze(2)).squeeze(2)
    q_draft = 1.0 if draft_probs is None else draft_probs.gather(2, draft_ids.unsqueeze(2))[..., 0]
    num_accepted = accepted_prefix(uniforms * q_draft < p_draft, num_drafts)
    p_final = target_probs[rows, num_accepted]
    at = num_accepted.clamp(max=k - 1)
    if draft_probs is None:
        q_final = torch.zeros_like(p_final).scatter_(1, draft_ids[rows, at].unsqueeze(1), 1.0)
    else:
        q_final = draft_probs[rows, at]
    rejected = (num_accepted < num_drafts).unsqueeze(1)
    weights = torch.where(rejected, (p_final - q_final).clamp(min=0.0), p_final)
    # An empty residual means p == q at that position, where rejecting had probability 0.
    weights = torch.where(weights.sum(1, keepdim=True) > 0, weights, p_final)
    final = (weights / noise).argmax(dim=-1)
    tokens = torch.cat([draft_ids, draft_ids.new_zeros(b, 1)], dim=1)
    tokens[rows, num_accepted] = final
    return num_accepted, tokens
