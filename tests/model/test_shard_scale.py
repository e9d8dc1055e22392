"""check_split on FP8 weight_scale_inv: a scale splits only with a 128-aligned weight."""

from __future__ import annotations

import pytest

from dsv3serve.parallel.config import LayoutError
from dsv3serve.parallel.shard import BLOCK, Placement, Split, check_split

SCALE = "model.layers.3.self_attn.q_b_proj.weight_scale_inv"


def _blocks(n: int) -> int:
    return -(-n // BLOCK)


ALIGNED = [
    (rows, parts)
    for rows in (128, 256, 1024, 24576, 32768)
    for parts in (1, 2, 4, 8)
    if rows % (parts * BLOCK) == 0
]


@pytest.mark.parametrize(("rows", "parts"), ALIGNED)
def test_scale_slice_is_the_weight_slices_blocks(rows: int, parts: int) -> None:
    """Where the weight split is aligned, rank r's scale rows are exactly the blocks that
    cover its weight rows [r * rows / parts, (r + 1) * rows / parts) (counted row by row)."""
    weight, scale = (rows, 512), (_blocks(rows), 4)
    for rank in range(parts):
        split = Split(0, rank, parts)
        check_split(SCALE, scale, Placement(split=split), fp8=True, weight_shape=weight)
        lo, hi = rank * rows // parts, (rank + 1) * rows // parts
        covering = sorted({row // BLOCK for row in range(lo, hi)})
        got = split.index(scale)[0]
        assert list(range(got.start, got.stop)) == covering


@pytest.mark.parametrize(("rows", "parts"), [(200, 2), (384, 2), (192, 2), (512, 8)])
def test_scale_of_an_unaligned_weight_split_is_refused(rows: int, parts: int) -> None:
    """(200, 2): 2 blocks divide by 2, yet the weight's halves (100 rows) cut a block."""
    placement = Placement(split=Split(0, 0, parts))
    with pytest.raises(LayoutError, match=f"{SCALE}: its weight .* not on a 128 boundary"):
        check_split(SCALE, (_blocks(rows), 4), placement, fp8=True, weight_shape=(rows, 512))


def test_scale_with_the_wrong_block_count_is_refused() -> None:
    placement = Placement(split=Split(0, 0, 2))
    with pytest.raises(LayoutError, match=r"expected 2 blocks along dim 0 .* found 4"):
        check_split(SCALE, (4, 4), placement, fp8=True, weight_shape=(256, 512))
