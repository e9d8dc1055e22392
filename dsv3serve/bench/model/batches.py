"""Synthetic forward batches for the model bench: prefill, decode and speculative verify.

Sequence ``i`` of a batch owns the contiguous, page-aligned slots
``[i * stride, i * stride + context + new_tokens)``, as the page allocator would hand out
fresh pages; the pool is pre-filled with random latents, so the context is "cached".
"""

from __future__ import annotations

import random

import torch

from dsv3serve.forward_batch import ForwardBatch, SeqSpan


def seq_stride(context: int, new_tokens: int, page_size: int) -> int:
    """Slots reserved per sequence: context plus new tokens, rounded up to whole pages."""
    return -(-(context + new_tokens) // page_size) * page_size


def kv_tokens_needed(batch_sizes: list[int], context: int, new_tokens: int, page_size: int) -> int:
    """Pool slots for the largest batch of ``context``-long sequences."""
    return max(batch_sizes, default=0) * seq_stride(context, new_tokens, page_size)


def _tokens(n: int, vocab: int, rng: random.Random) -> list[int]:
    return [rng.randrange(2, vocab) for _ in range(n)]


def context_spans(
    batch_size: int, context: int, new_tokens: int, page_size: int, vocab: int, seed: int = 0
) -> list[SeqSpan]:
    """``batch_size`` sequences with ``context`` cached tokens, each adding ``new_tokens``,
    given by page tables as the engine gives them."""
    rng = random.Random(seed)
    stride = seq_stride(context, new_tokens, page_size)
    spans = []
    for i in range(batch_size):
        first = i * stride // page_size
        pages = list(range(first, first + stride // page_size))
        spans.append(SeqSpan.from_pages(_tokens(new_tokens, vocab, rng), context, pages, page_size))
    return spans


def context_batch(
    batch_size: int,
    context: int,
    new_tokens: int,
    page_size: int,
    vocab: int,
    device: torch.device,
    seed: int = 0,
) -> ForwardBatch:
    """:func:`context_spans` as one batch.

    One new token each is a decode step; more is a speculative verify, which the engine
    runs in the decode (absorbed) MLA form, so ``is_decode`` is True either way.
    """
    spans = context_spans(batch_size, context, new_tokens, page_size, vocab, seed)
    return ForwardBatch.build(spans, device, decode=True)


def prefill_batch(length: int, vocab: int, device: torch.device, seed: int = 0) -> ForwardBatch:
    """One sequence of ``length`` new tokens from position 0 (slots ``0 .. length-1``)."""
    tokens = _tokens(length, vocab, random.Random(seed))
    return ForwardBatch.build([SeqSpan(tokens, 0, list(range(length)))], device)
