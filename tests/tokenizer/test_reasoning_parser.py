"""ReasoningParser: DeepSeek-R1 `<think>` splitting, whole and streamed."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dsv3serve.parsers.reasoning import ReasoningDelta, ReasoningParser, ReasoningResult
from dsv3serve.tokenizer.detokenizer import IncrementalDetokenizer
from dsv3serve.tokenizer.files import write_tokenizer_files
from dsv3serve.tokenizer.tokenizer import Tokenizer


def _stream(
    chunks: list[str], force_reasoning: bool = True
) -> tuple[str, str, list[ReasoningDelta]]:
    parser = ReasoningParser(force_reasoning=force_reasoning)
    deltas = [parser.feed(chunk) for chunk in chunks] + [parser.flush()]
    reasoning = "".join(d.reasoning_content for d in deltas)
    return reasoning, "".join(d.content for d in deltas), deltas


def _reference(text: str, force_reasoning: bool) -> tuple[str, str]:
    """Independent statement of the R1 rule, for comparison."""
    if text.startswith("<think>"):
        text = text[len("<think>") :]
    elif not force_reasoning:
        return "", text
    reasoning, _, content = text.partition("</think>")
    return reasoning, content


@pytest.mark.parametrize(
    ("text", "reasoning", "content"),
    [
        ("Let me think.\n</think>\n\nThe answer is 4.", "Let me think.\n", "\n\nThe answer is 4."),
        ("<think>\n推理过程</think>答案", "\n推理过程", "答案"),
        ("still thinking when cut off", "still thinking when cut off", None),
        ("</think>direct answer", None, "direct answer"),
        ("reason</think>", "reason", None),
        ("a</think>b</think>c", "a", "b</think>c"),
        ("x <think> y</think>z", "x <think> y", "z"),
        ("", None, None),
    ],
)
def test_parse_r1_output(text: str, reasoning: str | None, content: str | None) -> None:
    assert ReasoningParser.parse(text) == ReasoningResult(reasoning, content)


def test_without_forced_reasoning_needs_the_opening_tag() -> None:
    assert ReasoningParser.parse("plain answer", force_reasoning=False) == ReasoningResult(
        None, "plain answer"
    )
    assert ReasoningParser.parse("<think>r</think>c", force_reasoning=False) == ReasoningResult(
        "r", "c"
    )
    assert ReasoningParser.parse("<thin", force_reasoning=False) == ReasoningResult(None, "<thin")


def test_end_tag_split_across_chunks_is_never_leaked() -> None:
    parser = ReasoningParser()
    assert parser.feed("step one</th") == ReasoningDelta(reasoning_content="step one")
    assert parser.in_reasoning
    assert parser.feed("in") == ReasoningDelta()
    assert parser.feed("k>\n\nFinal") == ReasoningDelta(content="\n\nFinal")
    assert not parser.in_reasoning
    assert parser.feed(" answer </think>") == ReasoningDelta(content=" answer </think>")
    assert parser.flush().is_empty


def test_false_tag_prefix_is_released_as_reasoning() -> None:
    parser = ReasoningParser()
    assert parser.feed("a </") == ReasoningDelta(reasoning_content="a ")
    assert parser.feed("thinking> b") == ReasoningDelta(reasoning_content="</thinking> b")
    assert parser.feed("</thi") == ReasoningDelta()
    assert parser.flush() == ReasoningDelta(reasoning_content="</thi")


def test_opening_tag_split_across_chunks_is_dropped() -> None:
    parser = ReasoningParser()
    assert parser.feed("<th") == ReasoningDelta()
    assert parser.feed("ink>\nhm") == ReasoningDelta(reasoning_content="\nhm")


@pytest.mark.parametrize("force_reasoning", [True, False])
def test_every_single_split_point(force_reasoning: bool) -> None:
    text = "<think>\n分析：</think>\n\n结论 🙂"
    expected = _reference(text, force_reasoning)
    for cut in range(len(text) + 1):
        reasoning, content, _ = _stream([text[:cut], text[cut:]], force_reasoning)
        assert (reasoning, content) == expected, cut
    reasoning, content, _ = _stream(list(text), force_reasoning)
    assert (reasoning, content) == expected


_pieces = st.one_of(
    st.sampled_from(["<think>", "</think>", "<", "</", "</th", "think>", "\n", "你", "🙂", "a"]),
    st.text(max_size=5),
)


@settings(max_examples=300, deadline=None)
@given(
    parts=st.lists(_pieces, max_size=12),
    cuts=st.lists(st.integers(0, 80), max_size=8),
    force_reasoning=st.booleans(),
)
def test_random_chunking_matches_reference(
    parts: list[str], cuts: list[int], force_reasoning: bool
) -> None:
    text = "".join(parts)
    bounds = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    chunks = [text[a:b] for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
    reasoning, content, _ = _stream(chunks, force_reasoning)
    assert (reasoning, content) == _reference(text, force_reasoning)
    whole = ReasoningParser.parse(text, force_reasoning=force_reasoning)
    assert (whole.reasoning_content or "", whole.content or "") == (reasoning, content)


def test_r1_token_stream_through_detokenizer(tmp_path: Path) -> None:
    """R1 ids (`</think>` is one token there) streamed through detokenizer then parser."""
    write_tokenizer_files(tmp_path, variant="deepseek-r1")
    tok = Tokenizer.from_dir(tmp_path)
    output = "用户问的是 2+2。\n答案显然是 4 🙂\n</think>\n\n2 + 2 = **4**"
    ids = tok.encode(output, add_bos=False)
    assert tok.token_to_id("</think>") in ids
    detok, parser = IncrementalDetokenizer(tok), ReasoningParser()
    deltas = [parser.feed(detok.add(token_id)) for token_id in ids]
    deltas.append(parser.feed(detok.flush()))
    deltas.append(parser.flush())
    assert "".join(d.reasoning_content for d in deltas) == "用户问的是 2+2。\n答案显然是 4 🙂\n"
    assert "".join(d.content for d in deltas) == "\n\n2 + 2 = **4**"
    assert not any("\ufffd" in d.reasoning_content + d.content for d in deltas)
