"""OpenAI response bodies: ``ResponseBuilder`` turns backend TokenChunks into streamed chunks
or a whole response (chat and legacy completions), with logprobs and usage as vLLM / SGLang
report them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from dsv3serve.json_types import JSONObject
from router.api.chat_output import ChoiceParser, OutputParsing
from router.api.openai_protocol import TopLogprobs
from workers.protocol import TokenChunk

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
    echo: str = ""  # completions ``echo``: the prompt text each choice starts with
    parsing: OutputParsing | None = None  # chat: reasoning / tool-call split, if any


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
    parser: ChoiceParser | None = None  # splits the text when the request asks for it


def _lp(value: float) -> float:
    return max(value, LOGPROB_FLOOR)


def _token_entry(token_id: int, logprob: float, token_text: Callable[[int], str]) -> JSONObject:
    text = token_text(token_id)
    return {"token": text, "logprob": _lp(logprob), "bytes": list(text.encode("utf-8"))}


def chat_logprobs(
    ids: list[int], lps: list[float], tops: TopLogprobs, meta: ResponseMeta
) -> JSONObject:
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
) -> JSONObject:
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
        parsing = meta.parsing
        self.choices = [
            ChoiceState(parser=None if parsing is None else parsing.parser()) for _ in range(meta.n)
        ]
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

    def usage(self) -> JSONObject:
        """Token counts summed over the ``n`` choices; the prompt counts once."""
        completion = sum(max(len(s.token_ids), s.reported_tokens) for s in self.choices)
        prompt = self.meta.prompt_tokens
        usage: JSONObject = {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }
        if self.meta.parsing is not None and self.meta.parsing.reasoning is not None:
            parsers = [(s.parser, s.token_ids) for s in self.choices if s.parser is not None]
            reasoning = sum(parser.reasoning_tokens(ids) for parser, ids in parsers)
            usage["completion_tokens_details"] = {"reasoning_tokens": reasoning}
        return usage

    def parsed(self) -> list[ChoiceState]:
        """The choices whose text is split (all of a chat request that asks for it)."""
        return [s for s in self.choices if s.parser is not None]

    def _envelope(self, object_name: str, choices: list[JSONObject]) -> JSONObject:
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
    ) -> JSONObject | None:
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
        logprobs: JSONObject | None,
        reason: str | None,
        *,
        stream: bool,
        opening: bool = False,
    ) -> JSONObject:
        body: JSONObject = {"index": index}
        if self.meta.kind == "completion":
            body["text"] = text
        elif not stream:
            body["message"] = {"role": "assistant", "content": text}
        elif opening:
            body["delta"] = {"role": "assistant", "content": ""}
        else:
            body["delta"] = {"content": text} if text else {}
        return body | {"logprobs": logprobs, "finish_reason": reason}

    def opening_events(self) -> list[JSONObject]:
        """Chat streams open with one ``{"role": "assistant"}`` delta per choice; echoing
        completion streams with one event per choice carrying the prompt."""
        if self.meta.kind != "chat":
            return [
                self._envelope(
                    self._chunk_object(), [self._choice(i, self.meta.echo, None, None, stream=True)]
                )
                for i in range(self.meta.n)
                if self.meta.echo
            ]
        return [
            self._envelope(
                self._chunk_object(), [self._choice(i, "", None, None, stream=True, opening=True)]
            )
            for i in range(self.meta.n)
        ]

    def stream_event(self, chunk: TokenChunk) -> JSONObject | None:
        """The event for ``chunk``; None when it carries nothing to show."""
        state = self.add(chunk)
        if state.parser is not None:
            return self._parsed_event(chunk, state, state.parser)
        if not (chunk.text or chunk.finished or (self.meta.want_logprobs and chunk.token_ids)):
            return None
        logprobs = self._logprobs(chunk.token_ids, chunk.logprobs, chunk.top_logprobs, state)
        reason = chunk.finish_reason if chunk.finished else None
        choice = self._choice(chunk.index, chunk.text, logprobs, reason, stream=True)
        return self._envelope(self._chunk_object(), [choice])

    def _parsed_event(
        self, chunk: TokenChunk, state: ChoiceState, parser: ChoiceParser
    ) -> JSONObject | None:
        delta = parser.delta_body(parser.step(chunk.text, chunk.finished))
        if not (delta or chunk.finished or (self.meta.want_logprobs and chunk.token_ids)):
            return None
        logprobs = self._logprobs(chunk.token_ids, chunk.logprobs, chunk.top_logprobs, state)
        reason = parser.finish_reason(chunk.finish_reason) if chunk.finished else None
        choice: JSONObject = {"index": chunk.index, "delta": delta, "logprobs": logprobs}
        return self._envelope(self._chunk_object(), [choice | {"finish_reason": reason}])

    def usage_event(self) -> JSONObject:
        """The final ``stream_options.include_usage`` event: no choices, only usage."""
        return self._envelope(self._chunk_object(), []) | {"usage": self.usage()}

    # ---- whole response -------------------------------------------------------------
    def _final_choice(self, index: int, state: ChoiceState) -> JSONObject:
        logprobs = self._logprobs(state.token_ids, state.logprobs, state.top_logprobs, state)
        text = self.meta.echo + "".join(state.text)  # echo: completions only, no parser
        if state.parser is None:
            return self._choice(index, text, logprobs, state.finish_reason, stream=False)
        state.parser.parse_whole(text)
        reason = state.parser.finish_reason(state.finish_reason)
        message = state.parser.message()
        return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": reason}

    def response(self) -> JSONObject:
        """The non-streaming ``chat.completion`` / ``text_completion`` body."""
        choices = [self._final_choice(i, s) for i, s in enumerate(self.choices)]
        name = "chat.completion" if self.meta.kind == "chat" else "text_completion"
        return self._envelope(name, choices) | {"usage": self.usage()}
