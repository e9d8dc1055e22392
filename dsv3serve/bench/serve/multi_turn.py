"""The ``multi-turn`` workload: a fixed set of conversations revisited after other chats
push them out of the GPU KV pool (the hierarchical cache's case).

Round ``t`` sends turn ``t`` of each of ``mt_num_conversations`` conversations, then
``mt_num_fillers`` one-off filler prompts of ``mt_filler_len`` tokens. Turn ``t`` of a
conversation is its turns ``0 .. t`` of ``mt_turn_len`` random tokens each, joined by blank
lines: the text of turn ``t - 1`` is a prefix of it (the replies are not fed back, so the
requests are fixed before the run). Run it with ``--max-concurrency`` at most the fillers
per round, so a conversation's turns do not overlap.
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Sequence
from typing import Any

from dsv3serve.bench.serve.client import RequestResult
from dsv3serve.bench.serve.config import BenchServeConfig
from dsv3serve.bench.serve.prompts import BenchRequest, exact_prompt
from dsv3serve.tokenizer.tokenizer import Tokenizer

KINDS = ("first_turn", "revisit", "filler")


def _text(tokenizer: Tokenizer, rng: random.Random, length: int) -> str:
    """Random text of ``length`` tokens (no BOS)."""
    return exact_prompt(tokenizer, rng, length + 1)


def _request(tokenizer: Tokenizer, text: str, output_len: int, kind: str) -> BenchRequest:
    return BenchRequest(text, len(tokenizer.encode(text, add_bos=True)), output_len, kind)


def multi_turn_requests(config: BenchServeConfig, tokenizer: Tokenizer) -> list[BenchRequest]:
    """``mt_num_turns`` rounds of every conversation's next turn followed by fillers."""
    rng = random.Random(config.seed)
    histories = [""] * config.mt_num_conversations
    requests: list[BenchRequest] = []
    for turn in range(config.mt_num_turns):
        kind = "first_turn" if turn == 0 else "revisit"
        for c in range(config.mt_num_conversations):
            message = _text(tokenizer, rng, config.mt_turn_len)
            histories[c] = f"{histories[c]}\n\n{message}" if histories[c] else message
            requests.append(_request(tokenizer, histories[c], config.mt_output_len, kind))
        for _ in range(config.mt_num_fillers):
            filler = _text(tokenizer, rng, config.mt_filler_len)
            requests.append(_request(tokenizer, filler, config.mt_output_len, "filler"))
    return requests


def ttft_by_kind(
    requests: Sequence[BenchRequest], results: Sequence[RequestResult]
) -> dict[str, Any]:
    """Mean and median TTFT (ms) of the successful requests of each kind, and their count."""
    out: dict[str, Any] = {}
    for kind in KINDS:
        ttfts = [
            res.ttft_s * 1000
            for req, res in zip(requests, results, strict=True)
            if req.kind == kind and res.success
        ]
        out[f"{kind}_requests"] = len(ttfts)
        out[f"{kind}_mean_ttft_ms"] = statistics.fmean(ttfts) if ttfts else None
        out[f"{kind}_median_ttft_ms"] = statistics.median(ttfts) if ttfts else None
    return out
