"""OpenAI request fields this server cannot honour: refused with 400, never ignored.

A client that sends one of these believes it had an effect; silently dropping it would be
a wrong answer with status 200. Each entry names the field, the values that ask for
nothing beyond what the server does anyway (accepted), and why any other value is refused.
Fields honoured elsewhere are not listed (tests/router/test_openai_fields.py holds the
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


# OpenAI's ``user`` (an end-user id for abuse monitoring) is accepted and ignored, as vLLM
# does: it changes no output (tests/router/test_openai_fields.py).
_SHARED: dict[str, Refusal] = {
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

# vLLM's and SGLang's extensions that this server does not honour (those it honours, such
# as top_k, min_p, stop_token_ids, regex or chat_template_kwargs, are request fields). A
# client moving from either sends them expecting an effect: an unknown name that no
# server uses is still ignored, as vLLM ignores it. vLLM's ``request_id`` is ignored on
# purpose: the server assigns every id (tests/router/test_openai_api_errors.py).
_GUIDED = "use response_format (json_schema, json_object), regex or ebnf"
_EXTENSIONS: dict[str, Refusal] = {
    "guided_json": _never(_GUIDED),
    "guided_regex": _never(_GUIDED),
    "guided_choice": _never(_GUIDED),
    "guided_grammar": _never(_GUIDED),
    "guided_decoding_backend": _never(_GUIDED),
    "guided_whitespace_pattern": _never(_GUIDED),
    "structured_outputs": _never(_GUIDED),
    "structural_tag": _never("structural tags are not supported"),
    "json_schema": _never(_GUIDED),  # SGLang's top-level field
    "bad_words": Refusal("bad_words is not supported (use logit_bias)", lambda v: v == []),
    "allowed_token_ids": _never("allowed_token_ids is not supported (use logit_bias)"),
    "truncate_prompt_tokens": _never("prompts are never truncated: a long one gets 400"),
    "include_stop_str_in_output": Refusal("stop strings are never included", lambda v: v is False),
    "no_stop_trim": Refusal("stop strings are always trimmed", lambda v: v is False),
    "spaces_between_special_tokens": Refusal(
        "special tokens are decoded without added spaces", lambda v: v is True
    ),
    "return_tokens_as_token_ids": Refusal("tokens are returned as text", lambda v: v is False),
    "return_hidden_states": Refusal("hidden states are not returned", lambda v: v is False),
    "use_beam_search": Refusal("beam search is not supported", lambda v: v is False),
    "length_penalty": Refusal("beam search is not supported", lambda v: v == 1),
    "priority": Refusal("requests have no priorities", lambda v: v == 0),
    "lora_request": _never("LoRA adapters are not supported"),
    "lora_path": _never("LoRA adapters are not supported"),
    "kv_transfer_params": _never("the KV transfer is internal to the PD app"),
    "mm_processor_kwargs": _never("only text input is supported"),
}
_CHAT_EXTENSIONS: dict[str, Refusal] = {
    "echo": Refusal("echoing the last message is not supported", lambda v: v is False),
    "add_generation_prompt": Refusal("the assistant turn is always opened", lambda v: v is True),
    "continue_final_message": Refusal(
        "a final assistant message is not continued", lambda v: v is False
    ),
    "chat_template": _never("the model's own chat template is used"),
    "documents": _never("documents are not passed to the chat template"),
}

REFUSED: Mapping[str, Mapping[str, Refusal]] = MappingProxyType(
    {
        "chat": MappingProxyType(_SHARED | _CHAT | _EXTENSIONS | _CHAT_EXTENSIONS),
        "completion": MappingProxyType(_SHARED | _COMPLETIONS | _EXTENSIONS),
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
