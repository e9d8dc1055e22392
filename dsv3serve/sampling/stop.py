"""When to stop a request: stop strings in streamed text, and stop / length on tokens."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from dsv3serve.sampling.sampling_params import SamplingParams

FinishReason = Literal["stop", "length"]


class StopStringMatcher:
    """Finds stop strings in incrementally decoded text without ever emitting them.

    Feed each newly decoded piece of text; the matcher returns what is safe to stream
    now and holds back the longest suffix that could still grow into a stop string, so
    a stop string split across tokens is caught. The stop is the occurrence that
    *completes* first in the text; among those ending at the same place, the longest
    (earliest-starting) wins. The result does not depend on how the text was chunked.
    """

    def __init__(self, stop: Sequence[str]) -> None:
        """``stop``: the stop strings, each non-empty."""
        if any(s == "" for s in stop):
            raise ValueError(f"expected non-empty stop strings, got {list(stop)!r}")
        self._stop = tuple(dict.fromkeys(stop))
        self._held = ""
        self._stopped = False

    @property
    def stopped(self) -> bool:
        """True once a stop string has been found."""
        return self._stopped

    def feed(self, new_text: str) -> tuple[str, bool]:
        """Return ``(text safe to emit now, whether a stop string was hit)``.

        On a hit the text is everything before the stop string not emitted yet, and the
        rest is discarded; after a hit every call returns ``("", True)``.
        """
        if self._stopped:
            return "", True
        text = self._held + new_text
        cut = self._first_stop(text)
        if cut is not None:
            self._held, self._stopped = "", True
            return text[:cut], True
        keep = self._partial_suffix_length(text)
        self._held = text[len(text) - keep :]
        return text[: len(text) - keep], False

    def flush(self) -> str:
        """At end of generation without a stop hit: the held-back text (else ``""``)."""
        held, self._held = self._held, ""
        return held

    def _first_stop(self, text: str) -> int | None:
        """Start index of the earliest-completing stop string in ``text``, or None."""
        best: tuple[int, int] | None = None  # (end, start)
        for s in self._stop:
            start = text.find(s)
            if start >= 0 and (best is None or (start + len(s), start) < best):
                best = (start + len(s), start)
        return None if best is None else best[1]

    def _partial_suffix_length(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of a stop."""
        longest = 0
        for s in self._stop:
            for length in range(min(len(s) - 1, len(text)), longest, -1):
                if text.endswith(s[:length]):
                    longest = length
                    break
        return longest


def check_stop_token(
    token_id: int,
    num_output_tokens: int,
    params: SamplingParams,
    eos_token_id: int | None,
) -> FinishReason | None:
    """Finish reason after appending ``token_id``, or None to keep generating.

    ``num_output_tokens`` counts the output including ``token_id``. Nothing stops a
    request before ``min_new_tokens``. Then EOS (unless ``ignore_eos``) and
    ``stop_token_ids`` give ``"stop"``, and reaching ``max_new_tokens`` gives
    ``"length"``; a stop token on the last allowed position reports ``"stop"``.
    """
    if num_output_tokens < params.min_new_tokens:
        return None
    if not params.ignore_eos and eos_token_id is not None and token_id == eos_token_id:
        return "stop"
    if token_id in params.stop_token_ids:
        return "stop"
    if num_output_tokens >= params.max_new_tokens:
        return "length"
    return None
