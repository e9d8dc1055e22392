"""Checks of a request's prompt and sampling fields, and the SamplingParams they make.

Every failure is an OpenAI-style 400 (:func:`router.api.errors.bad_request`) naming the
request's own field. No torch and no Ray are imported here.
"""

from __future__ import annotations

import re
from typing import Protocol

from pydantic import ValidationError

from dsv3serve.json_types import JSONObject
from dsv3serve.sampling.sampling_params import SamplingParams, SamplingParamsError
from dsv3serve.tokenizer.tokenizer import Tokenizer
from router.api.errors import bad_request
from router.api.openai_protocol import CompletionRequest, SamplingFields


class RequestLimits(Protocol):
    """The server limits a request is checked against (``APIConfig`` has them)."""

    @property
    def max_n(self) -> int: ...

    @property
    def max_model_len(self) -> int: ...


def check_token_ids(ids: list[int], vocab_size: int, param: str) -> None:
    """400 unless every id is a token of the model: in ``[0, vocab_size)``."""
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise bad_request(
            f"{param}: token ids must be in [0, {vocab_size}) (the model's vocabulary), got {bad}",
            param,
        )


def completion_prompt_ids(
    tokenizer: Tokenizer, body: CompletionRequest, vocab_size: int
) -> list[int]:
    """Token ids of a text prompt (with BOS) or the given ids as they are."""
    try:
        prompt = body.single_prompt()
    except ValueError as exc:
        raise bad_request(str(exc), "prompt") from None
    if not prompt:
        raise bad_request("prompt must not be empty", "prompt")
    if isinstance(prompt, str):
        return tokenizer.encode(prompt, add_bos=True)
    check_token_ids(prompt, vocab_size, "prompt")
    return list(prompt)


def check_context_length(
    prompt_len: int,
    max_tokens: int | None,
    max_model_len: int,
    prompt_param: str,
    tokens_param: str,
) -> None:
    """400 when the prompt leaves no room, or prompt + ``max_tokens`` exceeds the limit."""
    head = f"This model's maximum context length is {max_model_len} tokens. However, "
    if prompt_len >= max_model_len:
        raise bad_request(
            head + f"your {prompt_param} has {prompt_len} tokens, which leaves no room for "
            f"the completion. Please reduce the length of the {prompt_param}.",
            prompt_param,
            "context_length_exceeded",
        )
    if max_tokens is not None and max_tokens >= 1 and prompt_len + max_tokens > max_model_len:
        raise bad_request(
            head + f"you requested {prompt_len + max_tokens} tokens ({prompt_len} in the "
            f"{prompt_param}, {max_tokens} in the completion). Please reduce the length of "
            f"the {prompt_param} or completion.",
            tokens_param,
            "context_length_exceeded",
        )


def _public_names(message: str, body: SamplingFields) -> str:
    """``message`` of a SamplingParamsError with the request's field names in it
    (``max_tokens``, not ``max_new_tokens``)."""
    internal = re.compile(r"\b(" + "|".join(body.PARAM_NAMES) + r")\b")
    message = message.replace("invalid SamplingParams: ", "invalid request: ")
    return internal.sub(lambda m: body.param_name(m.group(0)), message)


def build_sampling_params(
    body: SamplingFields,
    prompt_len: int,
    limits: RequestLimits,
    prompt_param: str,
    extra: JSONObject | None = None,
) -> SamplingParams:
    """SamplingParams of ``body`` (and ``extra`` fields, e.g. a tool constraint);
    ``max_tokens`` defaults to what the context leaves."""
    if body.n > limits.max_n:
        raise bad_request(f"n must be <= {limits.max_n}, got {body.n}", "n")
    max_tokens = body.requested_max_tokens()
    tokens_param = body.param_name("max_new_tokens")
    check_context_length(prompt_len, max_tokens, limits.max_model_len, prompt_param, tokens_param)
    if max_tokens is None:
        max_tokens = limits.max_model_len - prompt_len
    try:
        kwargs = body.sampling_kwargs()
    except ValidationError as exc:  # a structured-output field that makes no Constraint
        param = (body.constraint_fields() or ["response_format"])[0]
        problem = exc.errors()[0]["msg"].removeprefix("Value error, ")
        raise bad_request(f"invalid {param}: {problem}", param) from None
    if extra and kwargs.get("constraint") is not None and extra.get("constraint") is not None:
        raise bad_request(
            "tool_choice forces a tool call, which constrains the output: it cannot be "
            "combined with response_format, regex or ebnf",
            "tool_choice",
        )
    try:
        return SamplingParams(**(kwargs | (extra or {})), max_new_tokens=max_tokens)
    except SamplingParamsError as exc:
        raise bad_request(_public_names(str(exc), body), body.param_name(exc.field)) from None
