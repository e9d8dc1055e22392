"""Requests into the engine and the incremental outputs it streams back."""

from __future__ import annotations

from dataclasses import dataclass, field

from dsv3serve.sampling.sampling_params import SamplingParams


@dataclass
class Request:
    """One generation request; the server assigns ``request_id``.

    Give either ``prompt`` (text, tokenized as-is with a BOS) or ``prompt_ids``.
    ``salt`` isolates prefix-cache sharing between tenants. ``dp_rank``: the DP-attention
    rank a router chose for it; a DP scheduler honours it unless invalid or full.
    """

    request_id: str
    params: SamplingParams = field(default_factory=SamplingParams)
    prompt: str | None = None
    prompt_ids: list[int] | None = None
    salt: str = ""
    dp_rank: int | None = None


@dataclass
class TokenOutput:
    """New tokens of one sequence (``index`` < n) since its previous output."""

    request_id: str
    index: int
    token_ids: list[int]
    text: str
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[dict[int, float]] = field(default_factory=list)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
