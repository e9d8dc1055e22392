"""row_argmax against torch.argmax, ties included."""

from __future__ import annotations

import pytest
import torch

from dsv3serve.kernels.argmax import _num_chunks, row_argmax


@pytest.mark.parametrize("vocab", [129280, 102400, 4099, 4096, 403])
def test_row_argmax_equals_torch_on_random_rows(vocab: int) -> None:
    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(5, vocab, generator=g)
    assert torch.equal(row_argmax(logits), logits.argmax(-1))


def test_ties_resolve_to_the_first_index_across_chunks() -> None:
    vocab = 129280
    chunk = vocab // _num_chunks(vocab)
    logits = torch.zeros(3, vocab, dtype=torch.bfloat16)
    logits[0, [5 * chunk + 3, 2 * chunk + 7, 9 * chunk]] = 4.0  # first in chunk 2
    logits[1, [chunk - 1, chunk]] = 1.0  # the last of chunk 0 beats the first of chunk 1
    logits[2] = -1.0  # every index ties: index 0
    assert row_argmax(logits).tolist() == [2 * chunk + 7, chunk - 1, 0]
    assert torch.equal(row_argmax(logits), logits.argmax(-1))


def test_chunks_divide_the_vocabulary() -> None:
    assert 129280 % _num_chunks(129280) == 0 and _num_chunks(129280) > 100
    assert _num_chunks(4099) == 1  # a prime: one reduction
