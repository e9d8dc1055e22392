"""Request intake: prompt validation and the sequences a request becomes."""

from __future__ import annotations

from typing import Any

from dsv3serve.engine.request import Request
from dsv3serve.engine.scheduler.sequence import Sequence
from dsv3serve.sampling.sampling_params import SamplingParams
from dsv3serve.tokenizer.tokenizer import Tokenizer


class InvalidRequestError(ValueError):
    """A request that can never run (bad prompt, too long, duplicate id)."""


def prompt_ids(req: Request, tokenizer: Tokenizer, vocab_size: int) -> list[int]:
    """``req``'s prompt as token ids in ``[0, vocab_size)``; raises InvalidRequestError."""
    if (req.prompt is None) == (req.prompt_ids is None):
        raise InvalidRequestError("exactly one of prompt and prompt_ids must be given")
    ids = (
        req.prompt_ids
        if req.prompt_ids is not None
        else tokenizer.encode(req.prompt or "", add_bos=True)
    )
    if not ids:
        raise InvalidRequestError("the prompt is empty")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise InvalidRequestError(f"prompt token ids must be in [0, {vocab_size}), got {bad[:5]}")
    return list(ids)


def check_logit_bias(params: SamplingParams, vocab_size: int) -> None:
    """Raise InvalidRequestError when a ``logit_bias`` token id is outside the vocabulary."""
    bad = sorted(t for t in params.logit_bias if t >= vocab_size)
    if bad:
        raise InvalidRequestError(
            f"logit_bias: token ids must be in [0, {vocab_size}), got {bad[:5]}"
        )


def new_sequence(req: Request, index: int, prompt: list[int], **extra: Any) -> Sequence:
    """Sequence ``index`` of ``req`` (``extra``: further ``Sequence`` fields)."""
    return Sequence(
        seq_id=f"{req.request_id}#{index}",
        prompt_ids=prompt,
        max_new_tokens=req.params.max_new_tokens,
        request_id=req.request_id,
        salt=req.salt,
        preferred_dp_rank=req.dp_rank,
        **extra,
    )
