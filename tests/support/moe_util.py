"""Shared pieces of the MoE tests: random routing, and the spec of ExpertBlocks."""

from __future__ import annotations

import torch

from dsv3serve.moe.align import ExpertBlocks
from dsv3serve.moe.gate import grouped_topk


def random_routing(
    t: int, e: int, top_k: int, n_group: int, topk_group: int, device: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [t, k] float32 scaled by 2.5, ids [t, k] int64) from the reference router."""
    logits = torch.randn(t, e, device=device)
    bias = torch.randn(e, device=device) * 0.1
    return grouped_topk(logits, bias, top_k, n_group, topk_group, 2.5)


def check_blocks(b: ExpertBlocks, topk_ids: torch.Tensor, num_experts: int) -> None:
    """Assert that ``b`` is a valid expert blocking of ``topk_ids`` (order within an expert
    free): every assignment with an id >= 0 once and no skipped (negative) one, each block
    one expert's, experts ascending, each expert ``ceil(count / block_m)`` blocks, padding
    exactly the sentinel, unused blocks -1."""
    m, bm = topk_ids.numel(), b.block_m
    flat = topk_ids.reshape(-1).long().cpu()
    kept = torch.nonzero(flat >= 0).flatten()
    counts = torch.bincount(flat[kept], minlength=num_experts)
    want_blocks = (counts + bm - 1) // bm
    total = int(b.num_padded)
    assert total == int(want_blocks.sum()) * bm, f"num_padded {total}"
    n = total // bm
    assert b.max_blocks >= n and b.sorted_ids.numel() == b.max_blocks * bm
    rows = b.sorted_ids[:total].cpu().long().view(n, bm)
    experts = b.expert_ids.cpu().long()
    assert bool((experts[n:] == -1).all()), "unused blocks must be -1"
    real = rows < m
    assert bool((rows[~real] == m).all()), "padding must hold the sentinel M"
    assert torch.equal(rows[real].sort().values, kept), "each kept assignment exactly once"
    owner = experts[:n, None].expand(n, bm)
    assert torch.equal(flat[rows[real]], owner[real]), "a row in another expert's block"
    assert bool((experts[:n].diff() >= 0).all()), "experts out of order"
    assert torch.equal(torch.bincount(experts[:n], minlength=num_experts), want_blocks)


def drop_remote(
    weights: torch.Tensor, ids: torch.Tensor, held: range, local: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """The routing an EP rank holding experts ``held`` computes: other ranks' choices get weight
    0 and, when ``local``, id -1 (skipped); without ``local`` they keep their ids, so a
    reference runs those experts and multiplies them by 0 (an independent anchor)."""
    here = (ids >= held.start) & (ids < held.stop)
    w = torch.where(here, weights, 0.0)
    return w, (torch.where(here, ids, -1) if local else ids)
