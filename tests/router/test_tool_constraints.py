"""The structural tags of forced tool choices, compiled and matched by xgrammar itself.

Anchor: xgrammar's own DeepSeek-R1 tool-call structural tag (``get_model_structural_tag``,
written by others for the same format) accepts and rejects the same outputs as ours.
"""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest
import xgrammar as xg
from chat_output_util import call_text, calls_section
from xgrammar.testing import _is_grammar_accept_string as accepts

from dsv3serve.parsers.tool_calls import ToolCallParser
from router.api.chat_tools import NamedToolChoice, ToolChoice, ToolDef
from router.api.tool_constraints import structural_tag_json, tool_call_structural_tag

PARAMS: dict[str, dict[str, Any]] = {
    "add": {
        "type": "object",
        "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["a"],
        "additionalProperties": False,
    },
    "paint": {
        "type": "object",
        "properties": {"color": {"enum": ["red", "blue"]}, "sizes": {"type": "array"}},
        "required": ["color"],
        "additionalProperties": False,
    },
}
TOOLS = [
    ToolDef.model_validate({"type": "function", "function": {"name": n, "parameters": p}})
    for n, p in PARAMS.items()
]
ADD, PAINT = ("add", '{"a": 3}'), ("paint", '{"color": "red", "sizes": [1, 2]}')
OUTPUTS = {
    "add": calls_section(ADD),
    "paint": calls_section(PAINT),
    "both": calls_section(ADD, PAINT),
    "add_twice": calls_section(ADD, ADD),
    "out_of_range": calls_section(("add", '{"a": 12}')),
    "extra_key": calls_section(("add", '{"a": 1, "b": 2}')),
    "bad_enum": calls_section(("paint", '{"color": "green"}')),
    "unknown_tool": calls_section(("mul", '{"a": 1}')),
    "text_first": "Sure. " + calls_section(ADD),
    "no_section_end": "<｜tool▁calls▁begin｜>" + call_text(*ADD),
    "plain_text": "I cannot call tools.",
    "empty_section": "<｜tool▁calls▁begin｜><｜tool▁calls▁end｜>",
}
NAMED_ADD = NamedToolChoice.model_validate({"type": "function", "function": {"name": "add"}})
CHOICES: list[tuple[ToolChoice, bool, dict[str, Any]]] = [
    ("required", True, {"tool_choice": "required"}),
    ("required", False, {"tool_choice": "required", "parallel_tool_calls": False}),
    (NAMED_ADD, True, {"tool_choice": {"type": "function", "function": {"name": "add"}}}),
]
# strict unset: xgrammar then follows the schema (strict=False would free the arguments;
# ours always follows it for a forced choice, which is what the choice promises).
OPENAI_TOOLS = [
    {"type": "function", "function": {"name": n, "parameters": p}} for n, p in PARAMS.items()
]


def ours(choice: ToolChoice, parallel: bool, opens_reasoning: bool = False) -> xg.Grammar:
    tag = tool_call_structural_tag(TOOLS, choice, parallel, opens_reasoning)
    assert tag is not None
    return xg.Grammar.from_structural_tag(structural_tag_json(tag))


def reference(kwargs: dict[str, Any], reasoning: str) -> xg.Grammar:
    tag = xg.get_model_structural_tag(
        "deepseek_r1", tools=OPENAI_TOOLS, reasoning=reasoning, **kwargs
    )
    return xg.Grammar.from_structural_tag(tag.model_dump_json())


@pytest.mark.parametrize(("choice", "parallel", "kwargs"), CHOICES)
def test_forced_choices_accept_what_xgrammars_deepseek_tag_accepts(
    choice: ToolChoice, parallel: bool, kwargs: dict[str, Any]
) -> None:
    mine, theirs = ours(choice, parallel), reference(kwargs, "disabled")
    verdicts = {name: accepts(mine, text) for name, text in OUTPUTS.items()}
    assert verdicts == {name: accepts(theirs, text) for name, text in OUTPUTS.items()}
    assert verdicts["add"] and not verdicts["out_of_range"] and not verdicts["plain_text"]


def test_reasoning_comes_first_when_the_prompt_opened_think() -> None:
    mine, theirs = ours("required", True, True), reference({"tool_choice": "required"}, "enabled")
    for text in ("Let me see.\n</think>" + OUTPUTS["add"], OUTPUTS["add"], "</think>" + "x"):
        assert accepts(mine, text) == accepts(theirs, text)
    assert accepts(mine, "Let me see.\n</think>" + OUTPUTS["add"])
    assert not accepts(mine, OUTPUTS["add"])  # the reasoning must be closed first


def test_named_choice_allows_only_that_function_once() -> None:
    grammar = ours(NAMED_ADD, True)
    assert [n for n, t in OUTPUTS.items() if accepts(grammar, t)] == ["add"]


def test_auto_is_free_unless_a_tool_is_strict() -> None:
    assert tool_call_structural_tag(TOOLS, "auto", True, False) is None
    assert tool_call_structural_tag(TOOLS, "none", True, False) is None
    strict = [
        TOOLS[0].model_copy(
            update={"function": TOOLS[0].function.model_copy(update={"strict": True})}
        ),
        TOOLS[1],
    ]
    tag = tool_call_structural_tag(strict, "auto", True, False)
    grammar = xg.Grammar.from_structural_tag(structural_tag_json(tag))
    assert accepts(grammar, "plain text") and accepts(grammar, "Sure. " + OUTPUTS["add"])
    assert not accepts(grammar, "Sure. " + OUTPUTS["out_of_range"])  # add is strict
    assert accepts(grammar, OUTPUTS["bad_enum"])  # paint is not


def test_what_the_constraint_accepts_the_parser_reads_as_valid_calls() -> None:
    """The hand-off: every output the required-choice grammar allows parses into calls
    whose arguments validate against their tool's schema."""
    grammar = ours("required", True)
    allowed = [name for name, text in OUTPUTS.items() if accepts(grammar, text)]
    assert allowed == ["add", "paint", "both", "add_twice"]
    for name in allowed:
        parser = ToolCallParser(PARAMS)
        deltas = [parser.feed(OUTPUTS[name]), parser.flush()]
        assert "".join(d.content for d in deltas) == ""
        calls: dict[int, dict[str, str]] = {}
        for piece in (p for d in deltas for p in d.calls):
            call = calls.setdefault(piece.index, {"name": piece.name or "", "arguments": ""})
            call["arguments"] += piece.arguments
        assert len(calls) == (2 if name in ("both", "add_twice") else 1)
        for call in calls.values():
            jsonschema.validate(json.loads(call["arguments"]), PARAMS[call["name"]])
