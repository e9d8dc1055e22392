"""Benchmark workloads: random prompts of exact token lengths, pairs from a ShareGPT JSON
file, and the registry ``sample_requests`` over every ``--dataset-name``."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from dsv3serve.bench.serve.config import BenchServeConfig, BenchServeError
from dsv3serve.bench.serve.multi_turn import multi_turn_requests
from dsv3serve.bench.serve.prompts import BenchRequest, exact_prompt
from dsv3serve.bench.serve.shared_prefix import shared_prefix_requests
from dsv3serve.tokenizer.tokenizer import Tokenizer


def _lengths(rng: random.Random, mean: int, ratio: float, low: int, n: int) -> list[int]:
    lo, hi = max(low, round(mean * (1 - ratio))), max(low, round(mean * (1 + ratio)))
    return [rng.randint(lo, hi) for _ in range(n)]


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
    first, second = texts
    if not (isinstance(first, str) and first and isinstance(second, str) and second):
        return None
    return first, second


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
        return shared_prefix_requests(config, tokenizer)
    if config.dataset_name == "multi-turn":
        return multi_turn_requests(config, tokenizer)
    return random_requests(config, tokenizer)
