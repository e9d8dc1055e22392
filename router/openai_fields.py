"""OpenAI request fields this server cannot honour: refused with 400, never ignored.

A client that sends one of these believes it had an effect; silently dropping it would be
a wrong answer with status 200. Each entry names the field, the values that ask for
nothing beyond what the server does anyway (accepted), and why any other value is refused.
Fields honoured elsewhere are not listed (tests/serving/test_openai_fields.py holds the
table of every OpenAI request field and where each is honoured or refused).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Literal


@dataclass(frozen=True)
class Refusal:
    """Why a field is refused, and which of its values are accepted as no-ops."""

    reason: str
    accepts: Callable[[Any], bool] = lambda _value: False


def _never(reason: str) -> Refusal:
    return Refusal(reason)


_SHARED: dict[str, Refusal] = {
    "user": _never("end-user ids are not recorded by this server"),
    "prompt_logprobs": _never("prompt logprobs are not computed by this server"),
}
_CHAT: dict[str, Refusal] = {
    "audio": _never("audio output is not supported"),
    "modalities": Refusal("only text output is supported", lambda v: v == ["text"]),
    "functions": _never("the deprecated function-calling fields are not supported"),
    "function_call": _never("the deprecated function-calling fields are not supported"),
    "metadata": _never("completions are not stored, so metadata has nowhere to go"),
    "store": Refusal("completions are not stored", lambda v: v is False),
    "moderation": _never("moderation is not run by this server"),
    "prediction": _never("predicted outputs are not supported"),
    "prompt_cache_key": _never("prefix caching is automatic; cache keys are not supported"),
    "prompt_cache_options": _never("prefix caching is automatic and has no options"),
    "prompt_cache_retention": _never("prefix cache retention cannot be chosen"),
    "reasoning_effort": _never("reasoning effort cannot be chosen"),
    "safety_identifier": _never("safety identifiers are not recorded by this server"),
    "service_tier": Refusal("there is one service tier", lambda v: v in ("auto", "default")),
    "verbosity": _never("verbosity cannot be chosen"),
    "web_search_options": _never("web search is not supported"),
}
_COMPLETIONS: dict[str, Refusal] = {
    "best_of": Refusal("best_of is not supported (use n)", lambda v: v == 1),
}

REFUSED: Mapping[str, Mapping[str, Refusal]] = MappingProxyType(
    {
        "chat": MappingProxyType(_SHARED | _CHAT),
        "completion": MappingProxyType(_SHARED | _COMPLETIONS),
    }
)


def refused_field(
    body: Mapping[str, Any], kind: Literal["chat", "completion"]
) -> tuple[str, str] | None:
    """``(param, message)`` for the first refused field ``body`` sets, else None.

    ``null`` means "not given", as everywhere in the request.
    """
    for name, refusal in REFUSED[kind].items():
        value = body.get(name)
        if value is not None and not refusal.accepts(value):
            return (
                name,
                f"{name} is not supported by this server: {refusal.reason} (got {value!r:.80})",
            )
    return None
