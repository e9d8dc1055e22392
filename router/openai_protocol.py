"""OpenAI wire shapes: request bodies (chat, legacy completions) and response bodies.

Field names and extensions follow vLLM / SGLang (``top_k``, ``min_p``, ``min_tokens``,
``repetition_penalty``, ``ignore_eos``, ``stop_token_ids``, ``skip_special_tokens``,
``chat_template_kwargs``). Unknown fields are ignored and explicit ``null`` means "not
given", as with vLLM. Types are strict: ``"2"`` is not an int, ``"yes"`` not a bool, and
``1.0`` not an int. Ranges are checked by SamplingParams, not here, so the limits live
in one place; ``PARAM_NAMES`` maps its field names back to the request's.
``ResponseBuilder`` turns backend TokenChunks into streamed chunks or a whole response.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from dsv3serve.engine.sampling_params import SamplingParams
from workers.protocol import TokenChunk

Message = dict[str, str]
TopLogprobs = list[list[tuple[int, float]]]  # per token: (token id, logprob) alternatives


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _drop_nulls(cls, data: Any) -> Any:
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None}
        return data


class StreamOptions(_Body):
    include_usage: bool = False


class TextPart(_Body):
    """One part of a message's content; only text parts are accepted."""

    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    """A conversation turn. ``developer`` is OpenAI's newer name for ``system``."""

    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]

    def as_template_message(self) -> Message:
        """``{"role", "content"}`` with text parts joined, as the chat template takes it."""
        role = "system" if self.role == "developer" else self.role
        if isinstance(self.content, str):
            return {"role": role, "content": self.content}
        return {"role": role, "content": "".join(part.text for part in self.content)}


class SamplingFields(_Body):
    """Fields shared by chat and completions requests."""

    PARAM_NAMES: ClassVar[dict[str, str]] = {
        "max_new_tokens": "max_tokens",
        "min_new_tokens": "min_tokens",
    }

    model: str | None = None
    n: int = 1
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    stream: bool = False
    stream_options: StreamOptions | None = None

    def requested_max_tokens(self) -> int | None:
        """The completion budget the client asked for, if any."""
        return self.max_tokens

    def top_logprobs_k(self) -> int | None:
        """SamplingParams.logprobs: None for no logprobs, else the number of alternatives."""
        return None

    def sampling_kwargs(self) -> dict[str, Any]:
        """SamplingParams keyword arguments, except ``max_new_tokens``."""
        same_name = SamplingParams.model_fields.keys() & type(self).model_fields.keys()
        given = {name: getattr(self, name) for name in same_name}
        given |= {"min_new_tokens": self.min_tokens, "logprobs": self.top_logprobs_k()}
        return {k: v for k, v in given.items() if v is not None}

    @property
    def include_usage(self) -> bool:
        """Whether a stream ends with a usage chunk."""
        return self.stream_options is not None and self.stream_options.include_usage

    def param_name(self, sampling_field: str) -> str:
        """The request field behind a SamplingParams field (for error ``param``)."""
        return self.PARAM_NAMES.get(sampling_field, sampling_field)

    def unsupported(self) -> tuple[str, str] | None:
        """``(param, message)`` for a request this server cannot honour, else None."""
        if self.stream_options is not None and not self.stream:
            return "stream_options", "stream_options is only allowed when stream is true"
        return None


class ChatCompletionRequest(SamplingFields):
    """POST /v1/chat/completions body."""

    PARAM_NAMES: ClassVar[dict[str, str]] = {
        "max_new_tokens": "max_tokens",
        "min_new_tokens": "min_tokens",
        "logprobs": "top_logprobs",
    }

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Any] | None = None

    def requested_max_tokens(self) -> int | None:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens

    def top_logprobs_k(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def param_name(self, sampling_field: str) -> str:
        if sampling_field == "max_new_tokens" and self.max_completion_tokens is not None:
            return "max_completion_tokens"
        return super().param_name(sampling_field)

    def unsupported(self) -> tuple[str, str] | None:
        if self.tools:
            return "tools", "tool calling is not supported by this server"
        if self.top_logprobs and not self.logprobs:
            return "top_logprobs", "top_logprobs requires logprobs to be true"
        return super().unsupported()

    def template_messages(self) -> list[Message]:
        """The conversation as the DeepSeek chat template takes it."""
        return [m.as_template_message() for m in self.messages]

    @property
    def thinking(self) -> bool | None:
        """``chat_template_kwargs.thinking`` (R1-style ``<think>`` prompt), if given."""
        value = (self.chat_template_kwargs or {}).get("thinking")
        return value if isinstance(value, bool) else None


class CompletionRequest(SamplingFields):
    """POST /v1/completions body. A batch of prompts must hold exactly one."""

    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None

    def top_logprobs_k(self) -> int | None:
        return self.logprobs

    def unsupported(self) -> tuple[str, str] | None:
        if self.echo:
            return "echo", "echo is not supported by this server"
        if self.suffix:
            return "suffix", "suffix is not supported by this server"
        return super().unsupported()

    def single_prompt(self) -> str | list[int]:
        """The one prompt (text or token ids); raises ValueError for a batch of several."""
        prompt = self.prompt
        is_batch = isinstance(prompt, list) and bool(prompt) and not isinstance(prompt[0], int)
        if not is_batch:
            return prompt  # type: ignore[return-value]
        if len(prompt) != 1:
            raise ValueError(
                f"expected one prompt per request, got a batch of {len(prompt)}; "
                "send each prompt as its own request"
            )
        return prompt[0]  # type: ignore[return-value]


# ---- responses ------------------------------------------------------------------------
LOGPROB_FLOOR = -9999.0  # JSON has no -inf; vLLM clamps the same way


@dataclass(frozen=True)
class ResponseMeta:
    """What every body of one response repeats, and how to format its tokens."""

    kind: Literal["chat", "completion"]
    request_id: str
    model: str
    created: int
    n: int
    prompt_tokens: int
    want_logprobs: bool
    token_text: Callable[[int], str]


@dataclass
class ChoiceState:
    """Everything one of the ``n`` sequences has produced so far."""

    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: TopLogprobs = field(default_factory=list)
    finish_reason: str | None = None
    reported_tokens: int = 0
    text_offset: int = 0  # completions logprobs: offset of the next token's text


def _lp(value: float) -> float:
    return max(value, LOGPROB_FLOOR)


def _token_entry(token_id: int, logprob: float, token_text: Callable[[int], str]) -> dict[str, Any]:
    text = token_text(token_id)
    return {"token": text, "logprob": _lp(logprob), "bytes": list(text.encode("utf-8"))}


def chat_logprobs(
    ids: list[int], lps: list[float], tops: TopLogprobs, meta: ResponseMeta
) -> dict[str, Any]:
    """Chat ``logprobs``: ``{"content": [{token, logprob, bytes, top_logprobs}]}``."""
    entries = []
    for i, (token_id, logprob) in enumerate(zip(ids, lps, strict=False)):
        entry = _token_entry(token_id, logprob, meta.token_text)
        top = tops[i] if i < len(tops) else []
        entry["top_logprobs"] = [_token_entry(t, lp, meta.token_text) for t, lp in top]
        entries.append(entry)
    return {"content": entries}


def completion_logprobs(
    ids: list[int],
    lps: list[float],
    tops: TopLogprobs,
    state: ChoiceState,
    meta: ResponseMeta,
) -> dict[str, Any]:
    """Legacy ``logprobs``: parallel lists; advances ``state.text_offset`` past the tokens."""
    tokens = [meta.token_text(t) for t in ids[: len(lps)]]
    offsets = []
    for token in tokens:
        offsets.append(state.text_offset)
        state.text_offset += len(token)
    top_dicts = []
    for i, (token, logprob) in enumerate(zip(tokens, lps, strict=False)):
        top = tops[i] if i < len(tops) else []
        top_dicts.append({token: _lp(logprob)} | {meta.token_text(t): _lp(v) for t, v in top})
    return {
        "tokens": tokens,
        "token_logprobs": [_lp(v) for v in lps],
        "top_logprobs": top_dicts,
        "text_offset": offsets,
    }


class ResponseBuilder:
    """Turns a request's TokenChunks into OpenAI bodies: stream events or one response."""

    def __init__(self, meta: ResponseMeta) -> None:
        self.meta = meta
        self.choices = [ChoiceState() for _ in range(meta.n)]
        self.cached_tokens = 0

    def add(self, chunk: TokenChunk) -> ChoiceState:
        """Record ``chunk``; raises ValueError when its index is not one of the ``n``."""
        if not 0 <= chunk.index < self.meta.n:
            raise ValueError(f"expected chunk index in [0, {self.meta.n}), got {chunk.index}")
        state = self.choices[chunk.index]
        state.text.append(chunk.text)
        state.token_ids += chunk.token_ids
        state.logprobs += chunk.logprobs
        state.top_logprobs += chunk.top_logprobs
        state.reported_tokens = max(state.reported_tokens, chunk.completion_tokens)
        if chunk.finished:
            state.finish_reason = chunk.finish_reason
        self.cached_tokens = max(self.cached_tokens, chunk.cached_tokens)
        return state

    def usage(self) -> dict[str, Any]:
        """Token counts summed over the ``n`` choices; the prompt counts once."""
        completion = sum(max(len(s.token_ids), s.reported_tokens) for s in self.choices)
        prompt = self.meta.prompt_tokens
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }

    def _envelope(self, object_name: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        meta = self.meta
        return {
            "id": meta.request_id,
            "object": object_name,
            "created": meta.created,
            "model": meta.model,
            "choices": choices,
        }

    def _logprobs(
        self, ids: list[int], lps: list[float], tops: TopLogprobs, state: ChoiceState
    ) -> dict[str, Any] | None:
        if not self.meta.want_logprobs:
            return None
        if self.meta.kind == "chat":
            return chat_logprobs(ids, lps, tops, self.meta)
        return completion_logprobs(ids, lps, tops, state, self.meta)

    # ---- streaming ----------------------------------------------------------------
    def _chunk_object(self) -> str:
        return "chat.completion.chunk" if self.meta.kind == "chat" else "text_completion"

    def _choice(
        self,
        index: int,
        text: str,
        logprobs: dict[str, Any] | None,
        reason: str | None,
        *,
        stream: bool,
        opening: bool = False,
    ) -> dict[str, Any]:
        body: dict[str, Any] = {"index": index}
        if self.meta.kind == "completion":
            body["text"] = text
        elif not stream:
            body["message"] = {"role": "assistant", "content": text}
        elif opening:
            body["delta"] = {"role": "assistant", "content": ""}
        else:
            body["delta"] = {"content": text} if text else {}
        return body | {"logprobs": logprobs, "finish_reason": reason}

    def opening_events(self) -> list[dict[str, Any]]:
        """Chat streams open with one ``{"role": "assistant"}`` delta per choice."""
        if self.meta.kind != "chat":
            return []
        return [
            self._envelope(
                self._chunk_object(), [self._choice(i, "", None, None, stream=True, opening=True)]
            )
            for i in range(self.meta.n)
        ]

    def stream_event(self, chunk: TokenChunk) -> dict[str, Any] | None:
        """The event for ``chunk``; None when it carries nothing to show."""
        state = self.add(chunk)
        if not (chunk.text or chunk.finished or (self.meta.want_logprobs and chunk.token_ids)):
            return None
        logprobs = self._logprobs(chunk.token_ids, chunk.logprobs, chunk.top_logprobs, state)
        reason = chunk.finish_reason if chunk.finished else None
        choice = self._choice(chunk.index, chunk.text, logprobs, reason, stream=True)
        return self._envelope(self._chunk_object(), [choice])

    def usage_event(self) -> dict[str, Any]:
        """The final ``stream_options.include_usage`` event: no choices, only usage."""
        return self._envelope(self._chunk_object(), []) | {"usage": self.usage()}

    # ---- whole response -------------------------------------------------------------
    def _final_choice(self, index: int, state: ChoiceState) -> dict[str, Any]:
        logprobs = self._logprobs(state.token_ids, state.logprobs, state.top_logprobs, state)
        text = "".join(state.text)
        return self._choice(index, text, logprobs, state.finish_reason, stream=False)

    def response(self) -> dict[str, Any]:
        """The non-streaming ``chat.completion`` / ``text_completion`` body."""
        choices = [self._final_choice(i, s) for i, s in enumerate(self.choices)]
        name = "chat.completion" if self.meta.kind == "chat" else "text_completion"
        return self._envelope(name, choices) | {"usage": self.usage()}
