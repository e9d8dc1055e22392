"""What constrained decoding must enforce for a chat request's ``tool_choice``.

A forced choice (``required``, a named function) and ``auto`` with a ``strict`` tool need
the sampler to keep the output in DeepSeek's tool-call format with arguments that follow
each tool's JSON schema. This module states that as an xgrammar *structural tag* (the
JSON form of ``xgrammar.StructuralTag``, which ``xgrammar.Grammar.from_structural_tag``
compiles, and which SGLang takes as ``response_format: {"type": "structural_tag"}``);
the router hands it to the engine as ``SamplingParams.constraint``, a ``structural_tag``
:class:`~dsv3serve.sampling.constraint.Constraint` holding the tag's JSON text. Only plain
JSON is built here: no xgrammar import. The tag states the format, not the whitespace
inside the arguments: the engine compiles them compact unless its
``disable_any_whitespace`` is off (``dsv3serve/engine/compact_tags.py``).
"""

from __future__ import annotations

import json
from typing import Any

from dsv3serve.json_types import JSONObject
from dsv3serve.parsers.tool_calls import ARGUMENTS_END, CALL_TYPE, HEADER_END
from dsv3serve.tokenizer.chat_template import (
    THINK_END,
    TOOL_CALL_BEGIN,
    TOOL_CALLS_BEGIN,
    TOOL_CALLS_END,
    TOOL_SEP,
)
from router.api.chat_tools import NamedToolChoice, ToolChoice, ToolDef

ANY_OBJECT: dict[str, Any] = {"type": "object"}


def _call_tag(tool: ToolDef, follow_schema: bool) -> JSONObject:
    """One call of ``tool``: its header, JSON arguments, the call's end marker."""
    function = tool.function
    schema = (function.parameters or ANY_OBJECT) if follow_schema else ANY_OBJECT
    return {
        "type": "tag",
        "begin": f"{TOOL_CALL_BEGIN}{CALL_TYPE}{TOOL_SEP}{function.name}{HEADER_END}",
        "content": {"type": "json_schema", "json_schema": schema},
        "end": ARGUMENTS_END,
    }


def _section(tags: list[JSONObject], one_call: bool) -> JSONObject:
    """The whole tool-call section: at least one call, newline-separated."""
    calls: JSONObject = {
        "type": "tags_with_separator",
        "tags": tags,
        "separator": "\n",
        "at_least_one": True,
        "stop_after_first": one_call,
    }
    return {"type": "tag", "begin": TOOL_CALLS_BEGIN, "content": calls, "end": TOOL_CALLS_END}


def _after_reasoning(body: JSONObject) -> JSONObject:
    """``body`` after the reasoning the prompt opened: any text up to ``</think>``."""
    reasoning: JSONObject = {
        "type": "tag",
        "begin": "",
        "content": {"type": "any_text"},
        "end": THINK_END,
    }
    return {"type": "sequence", "elements": [reasoning, body]}


def tool_call_structural_tag(
    tools: list[ToolDef], choice: ToolChoice, parallel: bool, opens_reasoning: bool
) -> JSONObject | None:
    """The structural tag ``choice`` needs, or None when the output is free.

    ``required``: the output is the tool-call section (at least one call of any tool).
    A named function: exactly one call of it. ``auto`` with a ``strict`` tool: free text,
    but a section once begun follows the format (strict tools' arguments their schema).
    ``opens_reasoning``: the prompt ended inside ``<think>``, so the constraint starts
    after the model's ``</think>``. ``parallel`` false allows one call only.
    """
    if isinstance(choice, NamedToolChoice):
        named = [t for t in tools if t.function.name == choice.function.name]
        body = _section([_call_tag(t, True) for t in named], one_call=True)
    elif choice == "required":
        body = _section([_call_tag(t, True) for t in tools], one_call=not parallel)
    elif choice == "auto" and any(t.function.strict for t in tools):
        section = _section([_call_tag(t, t.function.strict) for t in tools], not parallel)
        body = {"type": "triggered_tags", "triggers": [TOOL_CALLS_BEGIN], "tags": [section]}
        body["stop_after_first"] = True
    else:
        return None
    if opens_reasoning:
        body = _after_reasoning(body)
    return {"type": "structural_tag", "format": body}


def structural_tag_json(tag: JSONObject) -> str:
    """The tag as the JSON text of a ``structural_tag`` :class:`Constraint`."""
    return json.dumps(tag, ensure_ascii=False, separators=(",", ":"))
