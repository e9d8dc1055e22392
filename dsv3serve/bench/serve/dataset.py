"""Benchmark prompts: random ones of exact token lengths, or pairs from a ShareGPT JSON file."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dsv3serve.bench.serve.args import BenchServeConfig, BenchServeError
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


def _lengths(rng: random.Random, mean: int, ratio: float, low: int, n: int) -> list[int]:
    lo, hi = max(low, round(mean * (1 - ratio))), max(low, round(mean * (1 + ratio)))
    return [rng.randint(lo, hi) for _ in range(n)]


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


def random_requests(config: BenchServeConfig, tokenizer: Tokenizer) -> list[BenchRequest]:
    """``num_prompts`` random prompts; lengths exact unless ``random_range_ratio`` > 0."""
    rng = random.Random(config.seed)
    n, ratio = config.num_prompts, config.random_range_ratio
    inputs = _lengths(rng, config.random_input_len, ratio, 2, n)
    outputs = _lengths(rng, config.random_output_len, ratio, 1, n)
    return [
        BenchRequest(exact_prompt(tokenizer, rng, i), i, o)
        for i, o in zip(inputs, outputs, strict=True)
    ]


def _first_pair(entry: Any) -> tuple[str, str] | None:
    """The first two turns' texts (prompt, reply) of one ShareGPT entry, if it has them."""
    turns = entry.get("conversations") if isinstance(entry, dict) else None
    if not isinstance(turns, list) or len(turns) < 2:
        return None
    texts = [t.get("value") if isinstance(t, dict) else None for t in turns[:2]]
    if not all(isinstance(t, str) and t for t in texts):
        return None
    return texts[0], texts[1]


def load_sharegpt(path: Path) -> list[tuple[str, str]]:
    """(prompt, reply) pairs of a ShareGPT JSON file: a list of ``{"conversations": [...]}``."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise BenchServeError(f"expected a ShareGPT JSON file at {path}: {exc}") from None
    if not isinstance(data, list):
        raise BenchServeError(f"expected a JSON list in {path}, got {type(data).__name__}")
    return [pair for pair in map(_first_pair, data) if pair is not None]


def sharegpt_requests(config: BenchServeConfig, tokenizer: Tokenizer) -> list[BenchRequest]:
    """``num_prompts`` pairs, shuffled by ``seed``; the reply's length is the output length.

    Pairs with fewer than 2 prompt or reply tokens, or longer than
    ``sharegpt_context_len`` together, are skipped.
    """
    assert config.dataset_path is not None  # BenchServeConfig requires it for sharegpt
    pairs = load_sharegpt(config.dataset_path)
    random.Random(config.seed).shuffle(pairs)
    chosen: list[BenchRequest] = []
    for prompt, reply in pairs:
        prompt_len = len(tokenizer.encode(prompt, add_bos=True))
        output_len = config.sharegpt_output_len or len(tokenizer.encode(reply, add_bos=False))
        if (
            min(prompt_len, output_len) >= 2
            and prompt_len + output_len <= config.sharegpt_context_len
        ):
            chosen.append(BenchRequest(prompt, prompt_len, output_len))
        if len(chosen) == config.num_prompts:
            return chosen
    raise BenchServeError(
        f"expected {config.num_prompts} usable conversations in {config.dataset_path}, "
        f"found {len(chosen)} of {len(pairs)}"
    )


def sample_requests(config: BenchServeConfig, tokenizer: Tokenizer) -> list[BenchRequest]:
    """The requests of ``config.dataset_name``."""
    if config.dataset_name == "sharegpt":
        return sharegpt_requests(config, tokenizer)
    if config.dataset_name == "generated-shared-prefix":
        from dsv3serve.bench.serve.shared_prefix import shared_prefix_requests

        return shared_prefix_requests(config, tokenizer)
    if config.dataset_name == "multi-turn":
        from dsv3serve.bench.serve.multi_turn import multi_turn_requests

        return multi_turn_requests(config, tokenizer)
    return random_requests(config, tokenizer)
