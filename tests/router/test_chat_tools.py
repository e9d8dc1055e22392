"""Tool calling over HTTP with the official openai client.

Where the model must write a tool call, a FakeScriptedBackend stands in for it (the tiny
model's random weights cannot be asked for one); everything else is real. The tests that
use real generation say so: the prompt the tiny engine sees, and the forced tool choice,
whose constraint comes from the grammar engine.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import jsonschema
import openai
import pytest
from chat_output_util import (
    MODEL,
    ScriptedServer,
    calls_section,
    read_stream,
    scripted_server,
    whole_calls,
    without_ids,
)
from openai_api_util import (
    CHAT,
    Served,
    client_fixture,  # noqa: F401 (fixture client)
    served_fixture,  # noqa: F401 (fixture served)
    wait_idle,
)

from dsv3serve.tokenizer.chat_template import render_chat
from dsv3serve.tokenizer.locate import tokenizer_dir
from dsv3serve.tokenizer.tokenizer import Tokenizer
from router.api.chat_tools import ToolDef, tools_system_prompt

WEATHER_PARAMS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Tokyo", "Lima"]},
        "unit": {"type": "string", "enum": ["c", "f"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
ADD_PARAMS = {
    "type": "object",
    "properties": {
        "a": {"type": "integer", "minimum": 0, "maximum": 9},
        "b": {"type": "boolean"},
    },
    "required": ["a", "b"],
    "additionalProperties": False,
}
TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city.",
            "parameters": WEATHER_PARAMS,
        },
    },
    {"type": "function", "function": {"name": "add", "parameters": ADD_PARAMS}},
]
UNIQUE = {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}
UNIQUE_TOOL = {
    "type": "function",
    "function": {"name": "f", "parameters": {"type": "object", "properties": {"ids": UNIQUE}}},
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
PARIS = '{"city": "Paris", "unit": "c"}'


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_dir(tokenizer_dir("tiny"))


@pytest.fixture(scope="module", params=[1, 3], ids=["1-token-chunks", "3-token-chunks"])
def scripted(request: pytest.FixtureRequest, tokenizer: Tokenizer) -> Iterator[ScriptedServer]:
    yield from scripted_server(tokenizer, tokens_per_chunk=request.param)


def create(server: ScriptedServer, **kw: Any) -> Any:
    args = {"model": MODEL, "messages": ASK, "tools": TOOLS} | kw
    return server.client().chat.completions.create(**args)


# ---- auto: calls read from the output (fake model) -------------------------------------------
def test_auto_call_whole_and_streamed(scripted: ScriptedServer) -> None:
    scripted.say("Let me check.\n" + calls_section(("get_weather", PARIS)))
    whole = create(scripted)
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me check.\n"
    calls = whole_calls(choice.message)
    assert without_ids(calls) == [{"name": "get_weather", "arguments": PARIS}]
    assert calls[0]["id"].startswith("call_")
    (streamed,), _ = read_stream(create(scripted, stream=True))
    assert streamed.content == choice.message.content
    assert without_ids(streamed.calls) == without_ids(calls)
    assert streamed.finish_reason == "tool_calls"


def test_parallel_calls_and_parallel_tool_calls_false(scripted: ScriptedServer) -> None:
    scripted.say(calls_section(("get_weather", PARIS), ("add", '{"a": 1, "b": true}')))
    both = create(scripted).choices[0].message
    assert both.content is None
    assert [c["name"] for c in whole_calls(both)] == ["get_weather", "add"]
    first_only = create(scripted, parallel_tool_calls=False).choices[0].message
    assert without_ids(whole_calls(first_only)) == [{"name": "get_weather", "arguments": PARIS}]
    (streamed,), _ = read_stream(create(scripted, parallel_tool_calls=False, stream=True))
    assert without_ids(streamed.calls) == without_ids(whole_calls(first_only))


def test_tools_reach_the_prompt_through_the_template(
    scripted: ScriptedServer, tokenizer: Tokenizer
) -> None:
    scripted.say("Sure.")
    create(scripted, messages=[{"role": "system", "content": "Be brief."}, *ASK])
    prompt = scripted.last_prompt()
    tools = [ToolDef.model_validate(t) for t in TOOLS]
    system = tools_system_prompt(tools, "auto", parallel=True)
    messages = [{"role": "system", "content": "Be brief."}, *ASK]
    assert prompt == render_chat([*messages, {"role": "system", "content": system}])
    assert prompt.startswith("<｜begin▁of▁sentence｜>Be brief.\n\n## Tools")
    assert json.dumps(WEATHER_PARAMS) in prompt and "### add" in prompt


def test_plain_answer_with_tools_is_content(scripted: ScriptedServer) -> None:
    scripted.say("It is sunny.")
    choice = create(scripted).choices[0]
    assert choice.message.content == "It is sunny." and not choice.message.tool_calls
    assert choice.finish_reason == "stop"


def test_tool_choice_none_leaves_tools_out(scripted: ScriptedServer) -> None:
    text = calls_section(("get_weather", PARIS))
    scripted.say(text)
    choice = create(scripted, tool_choice="none").choices[0]
    assert choice.message.content == text and not choice.message.tool_calls
    assert choice.finish_reason == "stop"
    assert "## Tools" not in scripted.last_prompt()


def test_tool_results_render_back_through_the_template(scripted: ScriptedServer) -> None:
    scripted.say(calls_section(("get_weather", PARIS)))
    assistant = create(scripted).choices[0].message
    scripted.say("It is 21 degrees in Paris.")
    call_id = assistant.tool_calls[0].id
    result = {"role": "tool", "tool_call_id": call_id, "content": '{"temp": 21}'}
    history = [*ASK, assistant.model_dump(exclude_none=True), result]
    answer = create(scripted, messages=history).choices[0]
    assert answer.message.content == "It is 21 degrees in Paris."
    call = {"type": "function", "function": {"name": "get_weather", "arguments": PARIS}}
    tools = [ToolDef.model_validate(t) for t in TOOLS]
    expected = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "content": '{"temp": 21}'},
        {"role": "system", "content": tools_system_prompt(tools, "auto", parallel=True)},
    ]
    prompt = scripted.last_prompt()
    assert prompt == render_chat(expected)
    assert prompt.endswith(
        '<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>{"temp": 21}<｜tool▁output▁end｜>'
        "<｜tool▁outputs▁end｜>"
    )
    assert "<｜tool▁sep｜>get_weather\n```json\n" + PARIS + "\n```" in prompt


@pytest.mark.parametrize("ending", ["<｜tool▁calls▁begin｜>", "<｜tool"])
def test_output_that_ends_inside_the_format_is_content(
    scripted: ScriptedServer, ending: str
) -> None:
    """What the parser held back (a marker that might begin a call) comes out at the end."""
    scripted.say("Let me see " + ending)
    choice = create(scripted).choices[0]
    assert choice.message.content == "Let me see " + ending and not choice.message.tool_calls
    (streamed,), _ = read_stream(create(scripted, stream=True))
    assert streamed.content == choice.message.content and streamed.calls == []


def test_truncated_call_keeps_partial_arguments(scripted: ScriptedServer) -> None:
    scripted.say(calls_section(("get_weather", PARIS)))
    choice = create(scripted, max_tokens=14).choices[0]
    (streamed,), _ = read_stream(create(scripted, max_tokens=14, stream=True))
    assert choice.finish_reason == streamed.finish_reason == "length"
    calls = whole_calls(choice.message)
    assert [c["name"] for c in calls] == ["get_weather"]
    assert PARIS.startswith(calls[0]["arguments"]) and calls[0]["arguments"] != PARIS
    assert without_ids(streamed.calls) == without_ids(calls)


# ---- bad tool requests: 400 with the field named ---------------------------------------------
def _bad(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": ASK} | fields


BAD_REQUESTS = [
    (_bad(tools=[{"type": "function", "function": {"name": "has space"}}]), "tools[0]"),
    (_bad(tools=[TOOLS[1], TOOLS[1]]), "tools"),
    (_bad(tools=[{"type": "retrieval"}]), "tools"),
    (_bad(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}), "nope"),
    (_bad(tool_choice="required"), "tool_choice"),
    (_bad(tools=TOOLS, tool_choice="sometimes"), "tool_choice"),
    (_bad(messages=[{"role": "tool"}]), "content"),
    (_bad(tools=[UNIQUE_TOOL], tool_choice="required"), "'uniqueItems' is not supported"),
    (_bad(messages=[{"role": "user", "content": "x", "tool_calls": []}]), None),
    (
        _bad(
            messages=[{"role": "user", "content": "x", "tool_calls": [{"function": {"name": "f"}}]}]
        ),
        "messages",
    ),
]


@pytest.mark.parametrize(("body", "mentions"), BAD_REQUESTS)
def test_bad_tool_requests_are_400(
    scripted: ScriptedServer, body: dict[str, Any], mentions: str | None
) -> None:
    import httpx

    response = httpx.post(scripted.http.url + "/v1/chat/completions", json=body, timeout=30)
    if mentions is None:  # an empty tool_calls list is no calls: accepted
        assert response.status_code == 200
        return
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert mentions in error["message"] or mentions in (error.get("param") or "")


# ---- real generation (the tiny engine) -----------------------------------------------------
def test_real_generation_sees_the_tools_and_streams_like_whole(
    served: Served, client: openai.OpenAI
) -> None:
    kw = {"model": MODEL, "messages": CHAT, "tools": TOOLS, "temperature": 0, "max_tokens": 8}
    whole = client.chat.completions.create(**kw)
    tools = [ToolDef.model_validate(t) for t in TOOLS]
    text = tools_system_prompt(tools, "auto", True)
    system = {"role": "system", "content": text, "trusted": True}  # its markers are tokens
    prompt = served.engine.tokenizer.encode_chat([*CHAT, system])
    assert whole.usage.prompt_tokens == len(prompt)
    (streamed,), _ = read_stream(client.chat.completions.create(stream=True, **kw))
    assert streamed.content == (whole.choices[0].message.content or "")
    assert without_ids(streamed.calls) == without_ids(whole_calls(whole.choices[0].message))
    wait_idle(served)


FORCED = [
    {"type": "function", "function": {"name": "add"}},
    {"type": "function", "function": {"name": "get_weather"}},
    "required",
]


@pytest.mark.parametrize("choice", FORCED, ids=["add", "get_weather", "required"])
def test_forced_tool_choice_yields_a_call_that_validates(
    served: Served, client: openai.OpenAI, choice: Any
) -> None:
    """Real generation: the random tiny model, constrained by the structural tag."""
    kw = {"model": MODEL, "messages": ASK, "tools": TOOLS, "tool_choice": choice}
    kw |= {"temperature": 1.0, "seed": 3, "max_tokens": 200}
    whole = client.chat.completions.create(**kw)
    (streamed,), _ = read_stream(client.chat.completions.create(stream=True, **kw))
    calls = whole_calls(whole.choices[0].message)
    assert len(calls) >= 1 and whole.choices[0].finish_reason == "tool_calls"
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for call in calls:
        if isinstance(choice, dict):
            assert call["name"] == choice["function"]["name"]
        jsonschema.validate(json.loads(call["arguments"]), schemas[call["name"]])
    assert without_ids(streamed.calls) == without_ids(calls)
    wait_idle(served)
