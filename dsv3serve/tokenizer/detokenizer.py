"""Streaming token-to-text conversion that never splits a UTF-8 character."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens kept in front of the first window; byte-level BPE needs none for
# correctness, the context only keeps the first windows consistent with the prompt.
PROMPT_CONTEXT_TOKENS = 5


class Decoder(Protocol):
    """What the detokenizer needs from a tokenizer."""

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    """Turns generated token ids into text pieces, one `add` per token.

    Two offsets into `ids` delimit the text already returned: `prefix_offset` starts
    a short decode window and `read_offset` ends the part of it already emitted. Each
    step decodes `ids[prefix_offset:read_offset]` and `ids[prefix_offset:]`; the
    difference is new text. While that decode ends in U+FFFD the last tokens hold an
    unfinished UTF-8 character, so nothing is emitted and the window grows. The
    offsets move forward only after a decode ends on a complete character, so every
    window starts on a character boundary and the pieces concatenate to
    `tokenizer.decode(generated_ids)` once `flush()` returns the held-back tail.

    Args:
        tokenizer: anything with `decode(ids, skip_special_tokens)`.
        prompt_ids: prompt ids to use as left context; never emitted. The prompt
            should end on a complete character (rendered prompts always do).
        skip_special_tokens: forwarded to `decode`.
    """

    def __init__(
        self,
        tokenizer: Decoder,
        prompt_ids: Sequence[int] | None = None,
        skip_special_tokens: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._ids: list[int] = list(prompt_ids or [])[-PROMPT_CONTEXT_TOKENS:]
        self._prompt_len = len(self._ids)
        self._prefix_offset = 0
        self._read_offset = self._prompt_len

    @property
    def generated_ids(self) -> list[int]:
        """Ids passed to `add` so far."""
        return self._ids[self._prompt_len :]

    def _decode(self, start: int, end: int | None = None) -> str:
        return self._tokenizer.decode(
            self._ids[start:end], skip_special_tokens=self._skip_special_tokens
        )

    def _pending_text(self) -> tuple[str, str]:
        """(text already emitted from the window, text of the whole window)."""
        emitted = self._decode(self._prefix_offset, self._read_offset)
        return emitted, self._decode(self._prefix_offset)

    def add(self, token_id: int) -> str:
        """Append one generated id; return the text it completes ("" while held back)."""
        self._ids.append(token_id)
        emitted, window = self._pending_text()
        if len(window) <= len(emitted) or window.endswith(REPLACEMENT_CHAR):
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return window[len(emitted) :]

    def add_many(self, token_ids: Sequence[int]) -> str:
        """`add` each id in turn and join the pieces."""
        return "".join(self.add(token_id) for token_id in token_ids)

    def flush(self) -> str:
        """Return the held-back tail (e.g. a truncated character as U+FFFD) at stream end."""
        emitted, window = self._pending_text()
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return window[len(emitted) :]
