"""Tools and reasoning over the gRPC service: the new proto fields, both directions.

The service (``router.api.grpc_api.GenerationService``) runs on the real OpenAIServer, with a
FakeScriptedBackend as the model (it writes the tool calls and ``</think>`` the tiny
model cannot be asked for) and a fake context in place of Ray Serve's gRPC proxy. Every
message is serialised and parsed again, as it would be on the wire.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from chat_output_util import ScriptedServer, calls_section, scripted_server

from dsv3serve.metrics import Identity, Metrics
from dsv3serve.tokenizer.files import write_tokenizer_files
from dsv3serve.tokenizer.tokenizer import Tokenizer
from router.api.auth import APIKeyAuth
from router.api.grpc_api import GenerationService
from router.proto import generate_pb2 as pb

THOUGHT, ANSWER = "Two and two.\n", "\n\n4"
ARGS = '{"a": 2, "b": 2}'
ADD = pb.FunctionTool(
    name="add",
    description="Add two integers.",
    parameters_json=json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}}),
)


class FakeContext:
    """What the service uses of Serve's gRPC context: metadata in, status out."""

    def __init__(self) -> None:
        self.code = grpc.StatusCode.OK
        self.details = ""

    def invocation_metadata(self) -> list[tuple[str, str]]:
        return []

    def set_code(self, code: grpc.StatusCode) -> None:
        self.code = code

    def set_details(self, details: str) -> None:
        self.details = details


@pytest.fixture(scope="module")
def r1(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ScriptedServer]:
    path: Path = tmp_path_factory.mktemp("r1_tokenizer")
    write_tokenizer_files(path, variant="deepseek-r1")
    yield from scripted_server(Tokenizer.from_dir(path), reasoning_parser="deepseek-r1")


def service(served: ScriptedServer) -> GenerationService:
    async def server() -> Any:
        return served.server

    metrics = Metrics(Identity("router", "router", "tiny"))
    return GenerationService(server, APIKeyAuth(None), metrics)


def wire(request: pb.ChatRequest) -> pb.ChatRequest:
    return pb.ChatRequest.FromString(request.SerializeToString())


def complete(served: ScriptedServer, request: pb.ChatRequest) -> tuple[Any, FakeContext]:
    context = FakeContext()
    reply = asyncio.run(service(served).complete(wire(request), context))
    return pb.GenerateResponse.FromString(reply.SerializeToString()), context


def stream(served: ScriptedServer, request: pb.ChatRequest) -> list[Any]:
    async def collect() -> list[Any]:
        replies = service(served).stream(wire(request), FakeContext())
        return [m async for m in replies]

    raw = asyncio.run(collect())
    return [pb.GenerateStreamResponse.FromString(m.SerializeToString()) for m in raw]


def ask(**fields: Any) -> pb.ChatRequest:
    messages = [pb.ChatMessage(role="user", content="What is 2+2?")]
    return pb.ChatRequest(messages=messages, **fields)


def test_reasoning_then_tool_call_whole_and_streamed(r1: ScriptedServer) -> None:
    r1.say(THOUGHT + "</think>" + calls_section(("add", ARGS)))
    whole, context = complete(r1, ask(tools=[ADD]))
    assert context.code == grpc.StatusCode.OK
    (choice,) = whole.choices
    assert (choice.reasoning_content, choice.text) == (THOUGHT, "")
    assert [(c.index, c.name, c.arguments) for c in choice.tool_calls] == [(0, "add", ARGS)]
    assert choice.tool_calls[0].id.startswith("call_") and choice.finish_reason == "tool_calls"
    assert 0 < whole.usage.reasoning_tokens < whole.usage.completion_tokens
    assert "### add" in r1.last_prompt()

    messages = stream(r1, ask(tools=[ADD]))
    pieces = [m.choice for m in messages if m.HasField("choice")]
    assert "".join(p.reasoning_content for p in pieces) == THOUGHT
    assert "".join(p.text for p in pieces) == ""
    calls = [c for p in pieces for c in p.tool_calls]
    assert calls[0].name == "add" and calls[0].id.startswith("call_")
    assert "".join(c.arguments for c in calls) == ARGS
    assert pieces[-1].finish_reason == "tool_calls"
    assert messages[-1].usage.reasoning_tokens == whole.usage.reasoning_tokens


def test_tool_turns_and_switches_reach_the_template(r1: ScriptedServer) -> None:
    r1.say(THOUGHT + "</think>" + ANSWER)
    call = pb.ToolCall(id="call_1", name="add", arguments=ARGS)
    history = [
        pb.ChatMessage(role="user", content="What is 2+2?"),
        pb.ChatMessage(role="assistant", tool_calls=[call]),
        pb.ChatMessage(role="tool", content="4", tool_call_id="call_1"),
    ]
    request = pb.ChatRequest(
        messages=history,
        tools=[ADD],
        tool_choice=pb.ToolChoice(mode="none"),
        separate_reasoning=False,
    )
    whole, _ = complete(r1, request)
    choice = whole.choices[0]
    assert choice.text == THOUGHT + "</think>" + ANSWER and choice.reasoning_content == ""
    assert not whole.usage.HasField("reasoning_tokens")
    prompt = r1.last_prompt()
    assert "<｜tool▁sep｜>add\n```json\n" + ARGS + "\n```" in prompt
    assert "<｜tool▁output▁begin｜>4<｜tool▁output▁end｜>" in prompt
    assert "## Tools" not in prompt  # tool_choice none


def test_include_reasoning_false_and_a_plain_answer(r1: ScriptedServer) -> None:
    r1.say(THOUGHT + "</think>" + ANSWER)
    whole, _ = complete(r1, ask(include_reasoning=False))
    assert (whole.choices[0].text, whole.choices[0].reasoning_content) == (ANSWER, "")
    assert whole.usage.reasoning_tokens > 0 and whole.choices[0].finish_reason == "stop"


@pytest.mark.parametrize(
    ("fields", "mentions"),
    [
        ({"tools": [pb.FunctionTool(name="add", parameters_json="{not json")]}, "parameters_json"),
        ({"tool_choice": pb.ToolChoice(function="add")}, "tool_choice"),
        ({"tools": [ADD], "tool_choice": pb.ToolChoice(function="mul")}, "mul"),
        ({"tools": [ADD], "tool_choice": pb.ToolChoice(mode="sometimes")}, "tool_choice"),
    ],
)
def test_bad_tool_fields_are_invalid_argument(
    r1: ScriptedServer, fields: dict[str, Any], mentions: str
) -> None:
    reply, context = complete(r1, ask(**fields))
    assert context.code == grpc.StatusCode.INVALID_ARGUMENT, context.details
    assert mentions in context.details and not reply.choices
