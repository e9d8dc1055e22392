"""A chat choice's generated text split into ``reasoning_content``, ``content`` and
``tool_calls``, as stream deltas and as the whole message.

Text goes through the reasoning splitter first (``<think>`` ... ``</think>``), and what is
content after it through the tool-call reader. The same parser serves a stream (``feed``
each chunk, ``flush`` at the end) and a whole response (``parse_whole``), so the deltas of
a stream concatenate to the message of the same output.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from dsv3serve.json_types import JSONObject, json_str
from dsv3serve.parsers.reasoning import ReasoningParser
from dsv3serve.parsers.tool_calls import ToolCallDelta, ToolCallParser
from dsv3serve.tokenizer.chat_template import THINK_END

ReasoningMode = Literal["forced", "detect"]  # output starts in reasoning / only after <think>


@dataclass(frozen=True)
class OutputParsing:
    """How a chat request's output is split; None fields turn that split off.

    ``reasoning``: ``forced`` when the prompt opened ``<think>`` (generation starts inside
    the reasoning), ``detect`` when reasoning counts only if the output opens ``<think>``.
    ``tool_names``: the tools whose calls are read. ``decode`` turns generated ids into
    text; it locates the end of the reasoning in token space for ``reasoning_tokens``.
    """

    reasoning: ReasoningMode | None
    include_reasoning: bool
    tool_names: tuple[str, ...] | None
    max_tool_calls: int | None
    decode: Callable[[list[int]], str]

    def parser(self) -> ChoiceParser:
        """A parser for one choice."""
        return ChoiceParser(self)


@dataclass(frozen=True)
class ChatDelta:
    """What one step releases; ``tool_calls`` name each call once, then argument pieces."""

    reasoning_content: str = ""
    content: str = ""
    tool_calls: tuple[ToolCallDelta, ...] = ()

    def __add__(self, other: ChatDelta) -> ChatDelta:
        return ChatDelta(
            self.reasoning_content + other.reasoning_content,
            self.content + other.content,
            self.tool_calls + other.tool_calls,
        )


@dataclass
class _Call:
    id: str
    name: str
    arguments: list[str] = field(default_factory=list)


def new_call_id() -> str:
    """A tool call id, OpenAI style."""
    return f"call_{uuid.uuid4().hex[:24]}"


class ChoiceParser:
    """Splits one choice's output and remembers everything it released."""

    def __init__(self, parsing: OutputParsing) -> None:
        self.parsing = parsing
        mode = parsing.reasoning
        self._reasoning = (
            None if mode is None else ReasoningParser(force_reasoning=mode == "forced")
        )
        names = parsing.tool_names
        self._tools = None if names is None else ToolCallParser(names, parsing.max_tool_calls)
        self._reasoning_parts: list[str] = []
        self._content_parts: list[str] = []
        self.calls: list[_Call] = []

    def feed(self, text: str) -> ChatDelta:
        """Split the next chunk of text."""
        if self._reasoning is None:
            return self._record(self._read_tools("", text, final=False))
        split = self._reasoning.feed(text)
        return self._record(self._read_tools(split.reasoning_content, split.content, final=False))

    def flush(self) -> ChatDelta:
        """Release what was held back; call once, at the end of the output."""
        if self._reasoning is None:
            return self._record(self._read_tools("", "", final=True))
        split = self._reasoning.flush()
        return self._record(self._read_tools(split.reasoning_content, split.content, final=True))

    def step(self, text: str, finished: bool) -> ChatDelta:
        """``feed`` a stream's chunk, and ``flush`` when it is the last."""
        delta = self.feed(text)
        return delta + self.flush() if finished else delta

    def parse_whole(self, text: str) -> ChatDelta:
        """The whole output at once (non-streaming responses)."""
        return self.feed(text) + self.flush()

    def _read_tools(self, reasoning: str, content: str, final: bool) -> ChatDelta:
        if self._tools is None:
            return ChatDelta(reasoning, content)
        first = self._tools.feed(content) if content else None
        last = self._tools.flush() if final else None
        parts = [p for p in (first, last) if p is not None]
        text = "".join(p.content for p in parts)
        return ChatDelta(reasoning, text, tuple(c for p in parts for c in p.calls))

    def _record(self, delta: ChatDelta) -> ChatDelta:
        self._reasoning_parts.append(delta.reasoning_content)
        self._content_parts.append(delta.content)
        for piece in delta.tool_calls:
            if piece.name is not None:
                self.calls.append(_Call(new_call_id(), piece.name))
            self.calls[piece.index].arguments.append(piece.arguments)
        return delta

    # ---- OpenAI shapes ----------------------------------------------------------------
    def finish_reason(self, reason: str | None) -> str | None:
        """``tool_calls`` when the output ended on its own after making calls."""
        return "tool_calls" if reason == "stop" and self.calls else reason

    def delta_body(self, delta: ChatDelta) -> JSONObject:
        """A stream ``delta``: only the fields with something new."""
        body: JSONObject = {}
        if delta.reasoning_content and self.parsing.include_reasoning:
            body["reasoning_content"] = delta.reasoning_content
        if delta.content:
            body["content"] = delta.content
        calls = self._call_deltas(delta.tool_calls)
        if calls:
            body["tool_calls"] = calls
        return body

    def _call_deltas(self, pieces: tuple[ToolCallDelta, ...]) -> list[JSONObject]:
        """One entry per call touched; a call's first entry carries its id and name."""
        entries: dict[int, JSONObject] = {}
        functions: dict[int, JSONObject] = {}  # each entry's "function", built in place
        for piece in pieces:
            entry = entries.setdefault(piece.index, {"index": piece.index})
            function = functions.setdefault(piece.index, {})
            entry.setdefault("function", function)
            if piece.name is not None:
                entry |= {"id": self.calls[piece.index].id, "type": "function"}
                function["name"] = piece.name
            before = json_str(function.get("arguments", ""), "arguments")
            function["arguments"] = before + piece.arguments
        return list(entries.values())

    def message(self) -> JSONObject:
        """The whole ``message`` of a non-streaming response."""
        content = "".join(self._content_parts)
        message: JSONObject = {"role": "assistant", "content": content or None}
        if self._reasoning is not None and self.parsing.include_reasoning:
            message["reasoning_content"] = "".join(self._reasoning_parts) or None
        if self.calls:
            message["tool_calls"] = [_call_body(call) for call in self.calls]
        elif self._reasoning is None:
            message["content"] = content  # plain text keeps "" as it has no other field
        return message

    def reasoning_tokens(self, token_ids: list[int]) -> int:
        """How many of ``token_ids`` are reasoning (``</think>`` included); 0 when off."""
        parser = self._reasoning
        if parser is None or not parser.has_reasoning:
            return 0
        if not parser.reasoning_ended:
            return len(token_ids)
        return _tokens_through(THINK_END, token_ids, self.parsing.decode)


def _call_body(call: _Call) -> JSONObject:
    function = {"name": call.name, "arguments": "".join(call.arguments)}
    return {"id": call.id, "type": "function", "function": function}


def _tokens_through(tag: str, ids: list[int], decode: Callable[[list[int]], str]) -> int:
    """The fewest leading ids whose text contains ``tag`` (binary search; text only grows)."""
    low, high = 1, len(ids)
    while low < high:
        middle = (low + high) // 2
        if tag in decode(ids[:middle]):
            high = middle
        else:
            low = middle + 1
    return low
