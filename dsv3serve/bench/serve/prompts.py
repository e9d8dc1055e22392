"""A benchmark request, and random prompt text of an exact token length."""

from __future__ import annotations

import random
from dataclasses import dataclass

from dsv3serve.bench.serve.config import BenchServeError
from dsv3serve.tokenizer.tokenizer import Tokenizer

ADJUST_ROUNDS = 16  # decode/encode round trips before starting over from fresh ids
FRESH_STARTS = 8


@dataclass(frozen=True)
class BenchRequest:
    """One prompt to send.

    ``prompt_len`` counts the prompt's tokens as a completions endpoint sees them (with
    BOS); a chat endpoint adds its template around it. ``output_len`` is sent as
    ``max_tokens``. ``kind`` names its part of a workload that has parts (``multi-turn``).
    """

    prompt: str
    prompt_len: int
    output_len: int
    kind: str = ""


def _draw(rng: random.Random, vocab: int, n: int) -> list[int]:
    return [rng.randrange(vocab) for _ in range(n)]


def _adjust(tokenizer: Tokenizer, rng: random.Random, ids: list[int], target: int) -> str | None:
    """Text whose encoding (no BOS) has ``target`` tokens, reached from ``ids``; or None.

    Decoding and re-encoding merges or splits tokens at their seams, so the length moves;
    each round cuts or pads the re-encoded ids and tries again.
    """
    for _ in range(ADJUST_ROUNDS):
        text = tokenizer.decode(ids)
        got = tokenizer.encode(text, add_bos=False)
        if len(got) == target:
            return text
        extra = _draw(rng, tokenizer.vocab_size, max(0, target - len(got)))
        ids = got[:target] + extra
    return None


def exact_prompt(tokenizer: Tokenizer, rng: random.Random, length: int) -> str:
    """Random text that encodes to exactly ``length`` tokens with BOS (``length`` >= 2)."""
    for _ in range(FRESH_STARTS):
        text = _adjust(tokenizer, rng, _draw(rng, tokenizer.vocab_size, length - 1), length - 1)
        if text is not None:
            return text
    raise BenchServeError(
        f"expected to build a prompt of {length} tokens, found none in {FRESH_STARTS} tries"
    )
