"""Expert blocking: the torch oracle against the spec (CPU). The Triton kernels are checked
against the same spec in test_moe_kernels_interp.py (interpreter) and test_moe_kernels_gpu.py."""

from __future__ import annotations

import pytest
import torch
from moe_util import check_blocks

from dsv3serve.moe.align import max_blocks, moe_align_block_size_ref


@pytest.mark.parametrize(
    ("t", "k", "e", "bm"),
    [(1, 8, 256, 16), (7, 8, 256, 16), (64, 8, 256, 32), (300, 8, 256, 64), (9, 4, 16, 16)],
)
def test_ref_blocks_meet_the_spec(t: int, k: int, e: int, bm: int) -> None:
    torch.manual_seed(t)
    ids = torch.stack([torch.randperm(e)[:k] for _ in range(t)])
    b = moe_align_block_size_ref(ids, e, bm)
    check_blocks(b, ids, e)
    assert b.max_blocks == max_blocks(t * k, e, bm)


def test_ref_skewed_and_within_expert_order() -> None:
    ids = torch.zeros(40, 1, dtype=torch.int64)  # every token to expert 0: 3 blocks of 16
    ids[5] = 3
    b = moe_align_block_size_ref(ids, 4, 16)
    check_blocks(b, ids, 4)
    assert b.expert_ids.tolist()[:4] == [0, 0, 0, 3]
    assert b.sorted_ids[:16].tolist() == [i for i in range(17) if i != 5]


def test_max_blocks_bounds_every_routing() -> None:
    """The bound is tight: M distinct experts with one row each, or one expert with all."""
    assert max_blocks(8, 256, 16) == 8
    assert max_blocks(2048, 256, 16) == -(-(2048 + 256 * 15) // 16)
    assert max_blocks(0, 256, 16) == 0


def test_ref_skips_negative_ids() -> None:
    """Choices of experts held by another EP rank (-1) join no block."""
    torch.manual_seed(3)
    ids = torch.stack([torch.randperm(16)[:4] for _ in range(30)])
    ids[torch.rand(ids.shape) < 0.6] = -1
    ids[0] = -1  # a token with nothing here
    b = moe_align_block_size_ref(ids, 16, 16)
    check_blocks(b, ids, 16)
    every_skip = torch.full((5, 4), -1)
    empty = moe_align_block_size_ref(every_skip, 16, 16)
    assert int(empty.num_padded) == 0 and bool((empty.expert_ids == -1).all())
