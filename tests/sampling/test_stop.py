"""Stop strings over streamed text (property-tested against a direct search) and
token-level finish reasons."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dsv3serve.sampling.sampling_params import SamplingParams
from dsv3serve.sampling.stop import StopStringMatcher, check_stop_token

ALPHABET = "ab#é"


def stream(stop: Sequence[str], chunks: Sequence[str]) -> tuple[str, bool]:
    """Everything the matcher lets through for ``chunks``, and whether it stopped."""
    matcher = StopStringMatcher(stop)
    emitted = []
    for chunk in chunks:
        text, hit = matcher.feed(chunk)
        emitted.append(text)
        if hit:
            return "".join(emitted), True
    return "".join(emitted) + matcher.flush(), False


def reference(stop: Sequence[str], text: str) -> tuple[str, bool]:
    """Truncate before the stop string that completes first (longest on a tie)."""
    for end in range(1, len(text) + 1):
        matches = [s for s in stop if text[:end].endswith(s)]
        if matches:
            return text[: end - max(map(len, matches))], True
    return text, False


def split(text: str, cuts: list[int]) -> list[str]:
    points = sorted({min(c, len(text)) for c in cuts})
    bounds = [0, *points, len(text)]
    return [text[a:b] for a, b in zip(bounds[:-1], bounds[1:], strict=True)]


texts = st.text(alphabet=ALPHABET, max_size=40)
stops = st.lists(st.text(alphabet=ALPHABET, min_size=1, max_size=4), min_size=1, max_size=3)
cuts = st.lists(st.integers(min_value=0, max_value=40), max_size=12)


@settings(max_examples=400, deadline=None)
@given(text=texts, stop=stops, cut_at=cuts)
def test_stream_equals_text_cut_at_first_stop(
    text: str, stop: list[str], cut_at: list[int]
) -> None:
    assert stream(stop, split(text, cut_at)) == reference(stop, text)


@settings(max_examples=200, deadline=None)
@given(text=texts, stop=st.text(alphabet=ALPHABET, min_size=1, max_size=4), cut_at=cuts)
def test_single_stop_cuts_before_its_first_occurrence(
    text: str, stop: str, cut_at: list[int]
) -> None:
    position = text.find(stop)
    expected = (text, False) if position < 0 else (text[:position], True)
    assert stream([stop], split(text, cut_at)) == expected


def test_stop_string_split_across_tokens_is_never_emitted() -> None:
    matcher = StopStringMatcher(["</answer>"])
    assert matcher.feed("42 </") == ("42 ", False)
    assert matcher.feed("ans") == ("", False)
    assert matcher.feed("wer> trailing") == ("", True)
    assert matcher.stopped and matcher.feed("more") == ("", True) and matcher.flush() == ""


def test_false_start_is_released() -> None:
    matcher = StopStringMatcher(["STOP"])
    assert matcher.feed("a ST") == ("a ", False)
    assert matcher.feed("ART") == ("START", False)
    assert matcher.feed("S") == ("", False)
    assert matcher.flush() == "S"


def test_no_stop_strings_passes_text_through() -> None:
    matcher = StopStringMatcher([])
    assert matcher.feed("anything") == ("anything", False)
    assert matcher.flush() == ""


def test_empty_stop_string_is_rejected() -> None:
    with pytest.raises(ValueError, match="non-empty"):
        StopStringMatcher(["ok", ""])


EOS = 2


@pytest.mark.parametrize(
    ("token", "count", "kwargs", "expected"),
    [
        (EOS, 3, {}, "stop"),
        (EOS, 3, {"ignore_eos": True}, None),
        (EOS, 3, {"min_new_tokens": 4}, None),
        (EOS, 4, {"min_new_tokens": 4}, "stop"),
        (9, 3, {"stop_token_ids": [9]}, "stop"),
        (9, 3, {"stop_token_ids": [9], "ignore_eos": True}, "stop"),
        (9, 2, {"stop_token_ids": [9], "min_new_tokens": 3}, None),
        (5, 3, {}, None),
        (5, 4, {"max_new_tokens": 4}, "length"),
        (5, 4, {"max_new_tokens": 4, "min_new_tokens": 4}, "length"),
        (EOS, 4, {"max_new_tokens": 4}, "stop"),
        (EOS, 4, {"max_new_tokens": 4, "ignore_eos": True}, "length"),
    ],
)
def test_check_stop_token(token: int, count: int, kwargs: dict, expected: str | None) -> None:
    assert check_stop_token(token, count, SamplingParams(**kwargs), EOS) == expected


def test_check_stop_token_without_eos_id() -> None:
    assert check_stop_token(EOS, 1, SamplingParams(), None) is None
