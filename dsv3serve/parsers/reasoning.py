"""Split DeepSeek-R1 output into `reasoning_content` and `content` as it streams."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from dsv3serve.tokenizer.chat_template import THINK_END, THINK_START


@dataclass(frozen=True)
class ReasoningDelta:
    """Text released by one `feed`/`flush`; either field may be empty."""

    reasoning_content: str = ""
    content: str = ""

    @property
    def is_empty(self) -> bool:
        """True when there is nothing to stream to the client for this step."""
        return not self.reasoning_content and not self.content


@dataclass(frozen=True)
class ReasoningResult:
    """Whole-response split, OpenAI style: a field is None when it has no text."""

    reasoning_content: str | None
    content: str | None


class _Phase(Enum):
    START = "start"  # not yet known whether the output opens with <think>
    REASONING = "reasoning"
    CONTENT = "content"


def partial_tag_len(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for size in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0


class ReasoningParser:
    """Incremental `<think>...</think>` splitter with DeepSeek-R1 semantics.

    R1's chat template already ends the prompt with `<think>\\n`, so the model
    usually starts straight with its reasoning and only emits `</think>`. With
    `force_reasoning=True` (R1's behaviour in vLLM and SGLang) all text before the
    first `</think>` is reasoning, an opening `<think>` at the very start is dropped,
    and everything after `</think>` is content, verbatim. With `force_reasoning=False`
    the output is reasoning only if it starts with `<think>`, otherwise all content.
    A tag split across chunks is held back until it can be told apart from text;
    for any chunking, the streamed fields concatenate to `parse(full_text)`.
    """

    def __init__(
        self,
        *,
        force_reasoning: bool = True,
        start_tag: str = THINK_START,
        end_tag: str = THINK_END,
    ) -> None:
        if not start_tag or not end_tag:
            raise ValueError(f"expected non-empty tags, got {start_tag!r} and {end_tag!r}")
        self._force_reasoning = force_reasoning
        self._start_tag = start_tag
        self._end_tag = end_tag
        self._phase = _Phase.START
        self._buffer = ""
        self._ended = False

    @property
    def in_reasoning(self) -> bool:
        """True until the end tag has been seen (or the output turned out to be content)."""
        return self._phase is not _Phase.CONTENT

    @property
    def has_reasoning(self) -> bool:
        """True once the output is known to open with reasoning (ended or not)."""
        return self._phase is _Phase.REASONING or self._ended

    @property
    def reasoning_ended(self) -> bool:
        """True once the end tag has been seen."""
        return self._ended

    def feed(self, text: str) -> ReasoningDelta:
        """Consume the next chunk of generated text; return what can be released now."""
        self._buffer += text
        return self._drain(final=False)

    def flush(self) -> ReasoningDelta:
        """Release any held-back partial tag at the end of the stream."""
        return self._drain(final=True)

    @classmethod
    def parse(cls, text: str, *, force_reasoning: bool = True) -> ReasoningResult:
        """Split a complete response (non-streaming requests)."""
        parser = cls(force_reasoning=force_reasoning)
        first, last = parser.feed(text), parser.flush()
        reasoning = first.reasoning_content + last.reasoning_content
        content = first.content + last.content
        return ReasoningResult(reasoning_content=reasoning or None, content=content or None)

    def _drain(self, final: bool) -> ReasoningDelta:
        if self._phase is _Phase.START and not self._leave_start(final):
            return ReasoningDelta()
        if self._phase is _Phase.REASONING:
            return self._drain_reasoning(final)
        content, self._buffer = self._buffer, ""
        return ReasoningDelta(content=content)

    def _leave_start(self, final: bool) -> bool:
        """Decide whether the output opens with the start tag; False while undecidable."""
        undecided = len(self._buffer) < len(self._start_tag)
        if not final and undecided and self._start_tag.startswith(self._buffer):
            return False
        if self._buffer.startswith(self._start_tag):
            self._buffer = self._buffer[len(self._start_tag) :]
            self._phase = _Phase.REASONING
        else:
            self._phase = _Phase.REASONING if self._force_reasoning else _Phase.CONTENT
        return True

    def _drain_reasoning(self, final: bool) -> ReasoningDelta:
        end = self._buffer.find(self._end_tag)
        if end >= 0:
            reasoning = self._buffer[:end]
            content = self._buffer[end + len(self._end_tag) :]
            self._buffer = ""
            self._phase = _Phase.CONTENT
            self._ended = True
            return ReasoningDelta(reasoning_content=reasoning, content=content)
        held = 0 if final else partial_tag_len(self._buffer, self._end_tag)
        cut = len(self._buffer) - held
        reasoning, self._buffer = self._buffer[:cut], self._buffer[cut:]
        return ReasoningDelta(reasoning_content=reasoning)
