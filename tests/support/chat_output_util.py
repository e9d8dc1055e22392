"""Servers and stream readers for the tool-call and reasoning tests (official openai client)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import openai
from fake_scripted_backend import FakeScriptedBackend, Script
from http_util import ServerThread

from dsv3serve.parsers.tool_calls import ARGUMENTS_END, HEADER_END
from dsv3serve.tokenizer.chat_template import (
    TOOL_CALL_BEGIN,
    TOOL_CALLS_BEGIN,
    TOOL_CALLS_END,
    TOOL_SEP,
)
from dsv3serve.tokenizer.tokenizer import Tokenizer
from router.api.openai_api import APIConfig, OpenAIServer, build_fastapi_app

MODEL = "deepseek-v3-tiny"
MAX_MODEL_LEN = 2048


def call_text(name: str, arguments: str) -> str:
    """One call in the DeepSeek-V3 format."""
    return f"{TOOL_CALL_BEGIN}function{TOOL_SEP}{name}{HEADER_END}{arguments}{ARGUMENTS_END}"


def calls_section(*calls: tuple[str, str]) -> str:
    """A tool-call section holding ``calls`` ((name, arguments) pairs)."""
    return TOOL_CALLS_BEGIN + "\n".join(call_text(n, a) for n, a in calls) + TOOL_CALLS_END


@dataclass
class ScriptedServer:
    """The real OpenAI server over a FakeScriptedBackend, on real HTTP."""

    backend: FakeScriptedBackend
    server: OpenAIServer
    http: ServerThread

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.http.url + "/v1", api_key="x", max_retries=0, timeout=60)

    def say(self, text: str) -> None:
        """Every choice of the next requests writes ``text``."""
        self.backend.script = lambda req, index: text

    def last_prompt(self) -> str:
        """The prompt text of the last request the backend got."""
        ids = self.backend.requests[-1].prompt_ids
        return self.backend.tokenizer.decode(ids, skip_special_tokens=False)


def scripted_server(
    tokenizer: Tokenizer, script: Script | None = None, tokens_per_chunk: int = 1, **config: Any
) -> Iterator[ScriptedServer]:
    backend = FakeScriptedBackend(tokenizer, script or (lambda req, i: "ok"), tokens_per_chunk)
    api = APIConfig(served_model_name=MODEL, max_model_len=MAX_MODEL_LEN, **config)
    server = OpenAIServer(api, tokenizer, backend)
    with ServerThread(build_fastapi_app(server)) as http:
        yield ScriptedServer(backend, server, http)


@dataclass
class StreamedChoice:
    """One choice of a stream, its deltas joined as the OpenAI docs say clients should."""

    reasoning: str = ""
    content: str = ""
    calls: list[dict[str, Any]] = field(default_factory=list)
    finish_reason: str | None = None

    def add(self, delta: Any, finish_reason: str | None) -> None:
        extra = delta.model_extra or {}
        self.reasoning += extra.get("reasoning_content") or ""
        self.content += delta.content or ""
        for call in delta.tool_calls or []:
            if call.id is not None:
                assert call.index == len(self.calls) and call.type == "function"
                self.calls.append({"id": call.id, "name": call.function.name, "arguments": ""})
            self.calls[call.index]["arguments"] += call.function.arguments or ""
        if finish_reason is not None:
            self.finish_reason = finish_reason


def read_stream(stream: Any) -> tuple[list[StreamedChoice], Any]:
    """(choices, usage) of a chat stream."""
    choices: dict[int, StreamedChoice] = {}
    usage = None
    for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            choices.setdefault(choice.index, StreamedChoice()).add(
                choice.delta, choice.finish_reason
            )
    return [choices[i] for i in sorted(choices)], usage


def whole_calls(message: Any) -> list[dict[str, str]]:
    """A whole message's tool calls as {id, name, arguments}."""
    return [
        {"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
        for c in message.tool_calls or []
    ]


def without_ids(calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in call.items() if k != "id"} for call in calls]
