"""OpenAI ``tools`` / ``tool_choice`` in chat requests: the models, their checks, and
how the tools reach the DeepSeek prompt.

The published DeepSeek-V3/R1 chat templates render assistant tool calls and tool
outputs but no tool definitions, so ``tools_system_prompt`` describes the tools (and
the call format of the templates) in one more system message; the templates join all
system messages at the top of the prompt. With ``tool_choice: "none"`` the tools are
left out of the prompt and the output is not read for calls.
"""

from __future__ import annotations

import json
import re
from typing import Any, Literal

from dsv3serve.json_types import JSONObject
from dsv3serve.sampling.schema_support import schema_problem
from dsv3serve.tokenizer.chat_template import (
    TOOL_CALL_BEGIN,
    TOOL_CALL_END,
    TOOL_CALLS_BEGIN,
    TOOL_CALLS_END,
    TOOL_SEP,
)
from router.api.request_part import RequestPart

TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for function names


class FunctionDef(RequestPart):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool = False


class ToolDef(RequestPart):
    """One entry of ``tools``; only function tools exist in the chat API."""

    type: Literal["function"]
    function: FunctionDef


class FunctionName(RequestPart):
    name: str


class NamedToolChoice(RequestPart):
    """``{"type": "function", "function": {"name": ...}}``: call exactly this function."""

    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class FunctionCall(RequestPart):
    name: str
    arguments: str | dict[str, Any]


class ToolCall(RequestPart):
    """An assistant turn's earlier call, sent back in ``messages``."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall

    def as_template_call(self) -> JSONObject:
        """The call as the chat template renders it."""
        function = {"name": self.function.name, "arguments": self.function.arguments}
        return {"type": self.type, "function": function}


def tool_problem(tools: list[ToolDef] | None, choice: ToolChoice | None) -> tuple[str, str] | None:
    """``(param, message)`` when ``tools`` / ``tool_choice`` cannot be served, else None."""
    names = [tool.function.name for tool in tools or []]
    for index, name in enumerate(names):
        if not TOOL_NAME.fullmatch(name):
            return (
                f"tools[{index}].function.name",
                f"expected a function name of 1 to 64 letters, digits, '_' or '-', got {name!r}",
            )
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        return "tools", f"expected unique function names, got {duplicates} more than once"
    if choice is None or choice == "none":
        return None
    if not names:
        return "tool_choice", f"tool_choice {_shown(choice)} needs a non-empty tools list"
    if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
        return (
            "tool_choice",
            f"tool_choice names function {choice.function.name!r}, which is not in tools ({names})",
        )
    return _parameters_problem(tools or [], choice)


def _parameters_problem(tools: list[ToolDef], choice: ToolChoice) -> tuple[str, str] | None:
    """A tool whose arguments the grammar must hold to its ``parameters`` schema (a forced
    call, or a ``strict`` tool) when the schema uses a keyword the grammar would drop."""
    for index, tool in enumerate(tools):
        function = tool.function
        named = isinstance(choice, NamedToolChoice) and choice.function.name == function.name
        enforced = named or choice == "required" or (choice == "auto" and function.strict)
        problem = schema_problem(function.parameters) if enforced else None
        if problem is not None:
            param = f"tools[{index}].function.parameters"
            return param, f"invalid {param}: {problem}"
    return None


def _shown(choice: ToolChoice) -> str:
    if isinstance(choice, NamedToolChoice):
        return f"(function {choice.function.name!r})"
    return repr(choice)


def effective_choice(tools: list[ToolDef] | None, choice: ToolChoice | None) -> ToolChoice:
    """OpenAI's default: ``auto`` with tools, ``none`` without."""
    if choice is not None:
        return choice
    return "auto" if tools else "none"


def _describe(function: FunctionDef) -> str:
    parameters = function.parameters or {"type": "object", "properties": {}}
    lines = [f"### {function.name}"]
    if function.description:
        lines.append(f"Description: {function.description}")
    lines.append("Parameters: " + json.dumps(parameters, ensure_ascii=False))
    return "\n".join(lines)


def _call_format() -> str:
    example_call = (
        f"{TOOL_CALL_BEGIN}function{TOOL_SEP}FUNCTION_NAME\n```json\nARGUMENTS\n```{TOOL_CALL_END}"
    )
    return (
        "To call functions, end your reply with one block of this form, one "
        f"{TOOL_CALL_BEGIN}...{TOOL_CALL_END} per call, separated by newlines:\n"
        f"{TOOL_CALLS_BEGIN}{example_call}{TOOL_CALLS_END}\n"
        "FUNCTION_NAME is one of the function names above, and ARGUMENTS is a JSON object "
        "that follows that function's Parameters schema."
    )


def _choice_rule(choice: ToolChoice, parallel: bool) -> str | None:
    if isinstance(choice, NamedToolChoice):
        return f"You must call the function {choice.function.name} exactly once."
    rules = []
    if choice == "required":
        rules.append("You must call at least one function.")
    if not parallel:
        rules.append("Call at most one function.")
    return " ".join(rules) or None


def tools_system_prompt(tools: list[ToolDef], choice: ToolChoice, parallel: bool) -> str:
    """The system text that offers ``tools`` to the model, with the ``tool_choice`` rule."""
    parts = ["## Tools", "You can call these functions:"]
    parts += [_describe(tool.function) for tool in tools]
    parts.append(_call_format())
    rule = _choice_rule(choice, parallel)
    if rule is not None:
        parts.append(rule)
    return "\n\n".join(parts)
