"""ToolCallParser: DeepSeek-V3 tool calls read from text, whole and streamed."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dsv3serve.parsers.tool_calls import ToolCallDelta, ToolCallParser, ToolParseDelta
from dsv3serve.tokenizer.chat_template import render_chat
from dsv3serve.tokenizer.detokenizer import IncrementalDetokenizer
from dsv3serve.tokenizer.locate import tokenizer_dir
from dsv3serve.tokenizer.tokenizer import Tokenizer

BEGIN, END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
NAMES = ("get_weather", "add")


def call_text(name: str, arguments: str) -> str:
    header = f"<｜tool▁call▁begin｜>function<｜tool▁sep｜>{name}"
    return f"{header}\n```json\n{arguments}\n```<｜tool▁call▁end｜>"


def section(*calls: tuple[str, str]) -> str:
    return BEGIN + "\n".join(call_text(n, a) for n, a in calls) + END


def run(chunks: list[str], names=NAMES, max_calls=None) -> tuple[str, list[dict[str, str]]]:
    """(content, calls) from streaming ``chunks``: call pieces joined per index."""
    parser = ToolCallParser(names, max_calls)
    deltas = [parser.feed(c) for c in chunks] + [parser.flush()]
    return _join(deltas)


def _join(deltas: list[ToolParseDelta]) -> tuple[str, list[dict[str, str]]]:
    calls: list[dict[str, str]] = []
    for delta in deltas:
        for piece in delta.calls:
            if piece.name is not None:
                assert piece.index == len(calls), "a call's name comes first, once"
                calls.append({"name": piece.name, "arguments": ""})
            calls[piece.index]["arguments"] += piece.arguments
    return "".join(d.content for d in deltas), calls


def test_one_call_whole() -> None:
    text = section(("get_weather", '{"city": "北京"}'))
    assert run([text]) == ("", [{"name": "get_weather", "arguments": '{"city": "北京"}'}])


def test_content_then_parallel_calls() -> None:
    text = "Let me check.\n" + section(("get_weather", '{"city": "Paris"}'), ("add", "{}"))
    content, calls = run([text])
    assert content == "Let me check.\n"
    assert calls == [
        {"name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"name": "add", "arguments": "{}"},
    ]


def test_plain_text_passes_through() -> None:
    assert run(["no tools here ``` <｜tool"]) == ("no tools here ``` <｜tool", [])


def test_max_calls_drops_later_calls() -> None:
    text = section(("add", '{"a": 1}'), ("add", '{"a": 2}')) + "tail"
    assert run([text], max_calls=1) == ("", [{"name": "add", "arguments": '{"a": 1}'}])


@pytest.mark.parametrize(
    "broken",
    [
        BEGIN + call_text("unknown_tool", "{}") + END,  # not one of the request's tools
        BEGIN + "<｜tool▁call▁begin｜>function get_weather\n```json\n{}\n```<｜tool▁call▁end｜>",
        BEGIN + "<｜tool▁call▁begin｜>function<｜tool▁sep｜>add\nnot a fence",
        BEGIN + "prose inside the section",
        BEGIN,  # cut off right after the marker
    ],
)
def test_broken_format_is_content_verbatim(broken: str) -> None:
    assert run([broken]) == (broken, [])


def test_text_after_a_call_is_content() -> None:
    text = BEGIN + call_text("add", "{}") + "\nDone."
    assert run([text]) == ("\nDone.", [{"name": "add", "arguments": "{}"}])


@pytest.mark.parametrize("cut", ["", "\n", "\n`", "\n``", "\n```"])
def test_a_call_cut_off_keeps_its_arguments_without_the_end_marker(cut: str) -> None:
    """Output ended by max_tokens inside a call: what was written of the arguments is
    returned, and the part of the end marker written before the cut is not."""
    text = BEGIN + "<｜tool▁call▁begin｜>function<｜tool▁sep｜>add\n```json\n" + '{"a": 1' + cut
    assert run([text]) == ("", [{"name": "add", "arguments": '{"a": 1'}])
    assert run(list(text)) == run([text])  # streamed token by token: the same


def test_streaming_releases_name_before_arguments_end() -> None:
    parser = ToolCallParser(NAMES)
    head = BEGIN + "<｜tool▁call▁begin｜>function<｜tool▁sep｜>add\n```json\n"
    assert parser.feed(head) == ToolParseDelta(calls=(ToolCallDelta(0, name="add"),))
    assert parser.feed('{"a": ') == ToolParseDelta(calls=(ToolCallDelta(0, arguments='{"a": '),))
    assert parser.feed("1}\n`") == ToolParseDelta(calls=(ToolCallDelta(0, arguments="1}"),))
    assert parser.feed("``<｜tool▁call▁end｜>" + END) == ToolParseDelta()
    assert parser.flush() == ToolParseDelta()


_pieces = st.one_of(
    st.sampled_from(
        [BEGIN, END, "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>", "function"]
        + ["add", "get_weather", "\n", "\n```json\n", "\n```", "```", '{"a": 1}', "你", " "]
    ),
    st.text(max_size=4),
)


@settings(max_examples=400, deadline=None)
@given(parts=st.lists(_pieces, max_size=14), cuts=st.lists(st.integers(0, 200), max_size=10))
def test_any_chunking_gives_the_whole_result(parts: list[str], cuts: list[int]) -> None:
    text = "".join(parts)
    bounds = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    chunks = [text[a:b] for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
    assert run(chunks) == run([text])


@settings(max_examples=200, deadline=None)
@given(
    content=st.text(max_size=10).filter(lambda t: "<｜" not in t),
    args=st.lists(st.dictionaries(st.text(max_size=5), st.integers()), min_size=1, max_size=3),
    cuts=st.lists(st.integers(0, 300), max_size=10),
)
def test_well_formed_calls_are_read_back_for_any_chunking(
    content: str, args: list[dict[str, int]], cuts: list[int]
) -> None:
    calls = [("add", json.dumps(a, ensure_ascii=False)) for a in args]
    text = content + section(*calls)
    bounds = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    chunks = [text[a:b] for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
    assert run(chunks) == (content, [{"name": n, "arguments": a} for n, a in calls])


def test_calls_rendered_by_the_chat_template_read_back_through_the_detokenizer() -> None:
    """The template's own rendering of an assistant turn (the published R1 form, which
    closes the section) is what the parser reads, token by token through the real
    tokenizer and detokenizer."""
    tok = Tokenizer.from_dir(tokenizer_dir("tiny"))
    tool_calls = [
        {"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "東京"}'}},
        {"type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}},
    ]
    turn = {"role": "assistant", "content": None, "tool_calls": tool_calls}
    prompt = render_chat([turn], flavor="deepseek-r1", add_generation_prompt=False)
    generated = prompt.split("<｜Assistant｜>", 1)[1].removesuffix("<｜end▁of▁sentence｜>")
    ids = tok.encode(generated, add_bos=False)
    detok = IncrementalDetokenizer(tok)
    content, calls = run([detok.add(i) for i in ids] + [detok.flush()])
    assert content == ""
    assert calls == [{"name": c["function"]["name"], **c["function"]} for c in tool_calls]
