"""Read DeepSeek-V3/R1 tool calls out of generated text, whole or as it streams.

The format is the one the published chat templates render for assistant tool calls
(SGLang's ``deepseekv3`` tool-call parser reads the same)::

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME
    ```json
    ARGUMENTS
    ```<｜tool▁call▁end｜>
    <｜tool▁call▁begin｜>...<｜tool▁call▁end｜><｜tool▁calls▁end｜>

Text before the section is content. ARGUMENTS are passed on verbatim (they are not
re-serialised), so streamed argument pieces concatenate to the whole-response string.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field
from enum import Enum

from dsv3serve.parsers.reasoning import partial_tag_len
from dsv3serve.tokenizer.chat_template import (
    TOOL_CALL_BEGIN,
    TOOL_CALL_END,
    TOOL_CALLS_BEGIN,
    TOOL_CALLS_END,
    TOOL_SEP,
)

HEADER_END = "\n```json\n"  # between the function name and its arguments
ARGUMENTS_END = "\n```" + TOOL_CALL_END
CALL_TYPE = "function"


@dataclass(frozen=True)
class ToolCallDelta:
    """New output of the call at ``index``: its name (first delta only) or argument text."""

    index: int
    name: str | None = None
    arguments: str = ""


@dataclass(frozen=True)
class ToolParseDelta:
    """What one ``feed``/``flush`` releases: content text and tool-call pieces."""

    content: str = ""
    calls: tuple[ToolCallDelta, ...] = ()


class _State(Enum):
    TEXT = "text"  # content, watching for the section's begin marker
    SECTION = "section"  # between calls: a call begins or the section ends
    HEADER = "header"  # "function<｜tool▁sep｜>NAME" up to HEADER_END
    ARGUMENTS = "arguments"  # argument text up to ARGUMENTS_END
    RAW = "raw"  # the output broke the format: the rest is content, verbatim
    DONE = "done"  # the call limit was reached: the rest is dropped


@dataclass
class _Out:
    content: list[str] = field(default_factory=list)
    calls: list[ToolCallDelta] = field(default_factory=list)

    def delta(self) -> ToolParseDelta:
        return ToolParseDelta("".join(self.content), tuple(self.calls))


class ToolCallParser:
    """Incremental DeepSeek tool-call reader.

    Args:
        tool_names: the request's tool names; a call to any other name (or a header
            that does not read ``function<｜tool▁sep｜>NAME``) breaks the format, and from
            there on the output, markers included, is returned as content.
        max_calls: stop after this many calls and drop the rest of the output
            (``parallel_tool_calls: false`` passes 1); None for no limit.

    A marker split across chunks is held back until it can be told apart from text, so
    for any chunking the released pieces concatenate to those of one ``feed`` of the
    whole text followed by ``flush``.
    """

    def __init__(self, tool_names: Collection[str], max_calls: int | None = None) -> None:
        if max_calls is not None and max_calls < 1:
            raise ValueError(f"expected max_calls >= 1 or None, got {max_calls}")
        self._names = frozenset(tool_names)
        self._max_calls = max_calls
        self._state = _State.TEXT
        self._buffer = ""
        self._unreleased = ""  # markers consumed for a call whose header is not yet read
        self.num_calls = 0

    def feed(self, text: str) -> ToolParseDelta:
        """Consume the next chunk of text; return what can be released now."""
        self._buffer += text
        return self._drain(final=False)

    def flush(self) -> ToolParseDelta:
        """Release everything held back at the end of the output."""
        return self._drain(final=True)

    def _drain(self, final: bool) -> ToolParseDelta:
        out = _Out()
        steps = {
            _State.TEXT: self._text,
            _State.SECTION: self._section,
            _State.HEADER: self._header,
            _State.ARGUMENTS: self._arguments,
        }
        while self._state in steps and steps[self._state](out, final):
            pass
        if self._state is _State.RAW:
            out.content.append(self._buffer)
        if self._state in (_State.RAW, _State.DONE):
            self._buffer = ""
        return out.delta()

    # Each step consumes from the buffer and returns True to run the next state's step.
    def _text(self, out: _Out, final: bool) -> bool:
        start = self._buffer.find(TOOL_CALLS_BEGIN)
        if start < 0:
            held = 0 if final else partial_tag_len(self._buffer, TOOL_CALLS_BEGIN)
            cut = len(self._buffer) - held
            out.content.append(self._buffer[:cut])
            self._buffer = self._buffer[cut:]
            return False
        out.content.append(self._buffer[:start])
        self._buffer = self._buffer[start + len(TOOL_CALLS_BEGIN) :]
        self._unreleased = TOOL_CALLS_BEGIN
        self._state = _State.SECTION
        return True

    def _section(self, out: _Out, final: bool) -> bool:
        rest = self._buffer.lstrip()
        for marker, state in ((TOOL_CALL_BEGIN, _State.HEADER), (TOOL_CALLS_END, _State.TEXT)):
            if rest.startswith(marker):
                self._unreleased += self._buffer[: len(self._buffer) - len(rest) + len(marker)]
                self._buffer = rest[len(marker) :]
                self._state = state
                if state is _State.TEXT:
                    self._unreleased = ""
                return True
        undecided = TOOL_CALL_BEGIN.startswith(rest) or TOOL_CALLS_END.startswith(rest)
        if undecided and not final:
            return False
        if rest or self._unreleased:
            self._break_format()
        return False

    def _header(self, out: _Out, final: bool) -> bool:
        end = self._buffer.find(HEADER_END)
        if end < 0:
            newline = self._buffer.find("\n")
            broken = newline >= 0 and not HEADER_END.startswith(self._buffer[newline:])
            if broken or final:
                self._break_format()
            return False
        name = _function_name(self._buffer[:end])
        if name is None or name not in self._names:
            self._break_format()
            return False
        out.calls.append(ToolCallDelta(self.num_calls, name=name))
        self._buffer = self._buffer[end + len(HEADER_END) :]
        self._unreleased = ""
        self._state = _State.ARGUMENTS
        return True

    def _arguments(self, out: _Out, final: bool) -> bool:
        end = self._buffer.find(ARGUMENTS_END)
        if end < 0:
            # A tail that may start the end marker is held back; at the end of an output
            # cut off inside the call (max_tokens) it is the marker's start: dropped.
            held = partial_tag_len(self._buffer, ARGUMENTS_END)
            self._add_arguments(out, self._buffer[: len(self._buffer) - held])
            self._buffer = "" if final else self._buffer[len(self._buffer) - held :]
            return False
        self._add_arguments(out, self._buffer[:end])
        self._buffer = self._buffer[end + len(ARGUMENTS_END) :]
        self.num_calls += 1
        done = self._max_calls is not None and self.num_calls >= self._max_calls
        self._state = _State.DONE if done else _State.SECTION
        return not done

    def _add_arguments(self, out: _Out, text: str) -> None:
        if text:
            out.calls.append(ToolCallDelta(self.num_calls, arguments=text))

    def _break_format(self) -> None:
        """Everything from the unreleased markers on is content."""
        self._buffer = self._unreleased + self._buffer
        self._unreleased = ""
        self._state = _State.RAW


def _function_name(header: str) -> str | None:
    """NAME of ``function<｜tool▁sep｜>NAME``; None when the header reads otherwise."""
    kind, sep, name = header.partition(TOOL_SEP)
    if not sep or kind.strip() != CALL_TYPE or not name.strip():
        return None
    return name.strip()
