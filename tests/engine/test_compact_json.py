"""Structured JSON output is compact by default (issue 45 part 5), and free with the
engine's ``disable_any_whitespace`` off (vLLM's name).

Given whitespace between JSON elements, the random tiny model spends its tokens on it
(``{\\t\\n\\t\\n   "city":\\n"...``): with it allowed, the bounded strict schema below
finished within 200 tokens on 0 of 20 seeds and the forced tool call parsed on 1 of 10.
The generation tests run the default app's model (tiny, FP8 weights) on the engine
directly, not over HTTP: the constraint is compiled and applied there, and the router
only builds the tool call's structural tag (``router.api.tool_constraints``), as here.
"""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
import xgrammar as xg
from chat_output_util import calls_section
from engine_util import make_engine
from schema_cases import valid
from xgrammar.testing import _is_grammar_accept_string as accepts

from dsv3serve.cli import build_parser
from dsv3serve.engine.compact_tags import compact_structural_tag
from dsv3serve.engine.config import EngineConfig
from dsv3serve.engine.engine import Engine
from dsv3serve.engine.grammar import GrammarCompiler
from dsv3serve.engine.request import Request
from dsv3serve.model.tiny import cached_tiny_checkpoint
from dsv3serve.parsers.tool_calls import ToolCallParser
from dsv3serve.sampling.constraint import Constraint
from dsv3serve.sampling.sampling_params import SamplingParams
from dsv3serve.tokenizer.tokenizer import Tokenizer
from router.api.chat_tools import NamedToolChoice, ToolDef
from router.api.tool_constraints import structural_tag_json, tool_call_structural_tag

pytestmark = pytest.mark.usefixtures("one_thread")
PROMPT = [5, 6, 7, 8]
MAX_TOKENS = 200


def _str(n: int) -> dict[str, Any]:
    return {"type": "string", "maxLength": n}


def _obj(props: dict[str, Any]) -> dict[str, Any]:
    strict = {"required": list(props), "additionalProperties": False}
    return {"type": "object", "properties": props} | strict


# every string has maxLength, every array maxItems, the integer a range
BOUNDED = _obj(
    {
        "name": _str(12),
        "tags": {"type": "array", "items": _str(8), "maxItems": 3},
        "address": _obj({"city": _str(12), "zip": _str(6)}),
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "active": {"type": "boolean"},
        "kind": {"enum": ["a", "b", "c"]},
    }
)
ARGS = _obj({"city": _str(12), "days": {"type": "integer", "minimum": 1, "maximum": 7}})
WEATHER = ToolDef.model_validate(
    {"type": "function", "function": {"name": "get_weather", "parameters": ARGS}}
)
FORCED = NamedToolChoice.model_validate({"type": "function", "function": {"name": "get_weather"}})


def forced_call_tag() -> str:
    """The structural tag the router sends for ``tool_choice`` naming get_weather."""
    tag = tool_call_structural_tag([WEATHER], FORCED, parallel=True, opens_reasoning=False)
    assert tag is not None
    return structural_tag_json(tag)


def in_tag(content: dict[str, Any]) -> dict[str, Any]:
    """A structural tag: ``content`` between ``<a>`` and ``</a>``."""
    tag = {"type": "tag", "begin": "<a>", "content": content, "end": "</a>"}
    return {"type": "structural_tag", "format": tag}


def compact(text: str) -> bool:
    """Whether JSON ``text`` has no whitespace outside its strings but the one space
    after each ``,`` and ``:``."""
    shape = re.sub(r'"(?:[^"\\]|\\.)*"', '""', text)
    return not re.search(r"\s", shape.replace(", ", ",").replace(": ", ":"))


Outputs = list[tuple[str, str | None]]


def run(engine: Engine, runs: dict[str, tuple[Constraint, int]]) -> dict[str, Outputs]:
    """For each name, (text, finish reason) of one sequence per seed under its constraint,
    temperature 1, MAX_TOKENS each; every sequence runs in one batch."""
    for name, (constraint, seeds) in runs.items():
        for seed in range(seeds):
            params = SamplingParams(
                temperature=1.0, seed=seed, max_new_tokens=MAX_TOKENS, constraint=constraint,
                skip_special_tokens=False,
            )  # fmt: skip
            engine.add_request(Request(f"{name}/{seed}", params, prompt_ids=PROMPT))
    outs: dict[str, list] = {}
    while engine.has_unfinished():
        for out in engine.step():
            entry = outs.setdefault(out.request_id, ["", None])
            entry[0] += out.text
            entry[1] = out.finish_reason if out.finished else entry[1]
    return {n: [tuple(outs[f"{n}/{i}"]) for i in range(k)] for n, (_, k) in runs.items()}


def call_arguments(text: str) -> list[str]:
    """The argument strings of the get_weather calls the tool-call parser reads in ``text``."""
    parser = ToolCallParser(["get_weather"])
    deltas = [parser.feed(text), parser.flush()]
    calls: dict[int, str] = {}
    for piece in (p for d in deltas for p in d.calls):
        calls[piece.index] = calls.get(piece.index, "") + piece.arguments
    return list(calls.values())


@pytest.fixture(scope="module")
def outputs() -> dict[str, Outputs]:
    """The bounded schema on 20 seeds and the forced call on 10, on the default app's
    model (tiny, FP8 weights, activations not quantised)."""
    runs = {
        "schema": (Constraint.json_schema(BOUNDED, strict=True), 20),
        "tool": (Constraint(kind="structural_tag", text=forced_call_tag()), 10),
    }
    return run(make_engine(), runs)


def test_bounded_strict_schema_finishes_within_200_tokens_on_20_seeds(
    outputs: dict[str, Outputs],
) -> None:
    outs = outputs["schema"]
    bad = [(r, text[:80]) for text, r in outs if r != "stop" or not valid(text, BOUNDED)]
    assert not bad, f"{len(bad)} of 20 did not finish valid within {MAX_TOKENS} tokens: {bad[:2]}"
    assert all(compact(text) for text, _ in outs), outs


def test_forced_tool_call_with_a_bounded_argument_parses_on_10_seeds(
    outputs: dict[str, Outputs],
) -> None:
    parsed = [(call_arguments(text), r, text) for text, r in outputs["tool"]]
    bad = [(r, text[:120]) for args, r, text in parsed if r != "stop" or len(args) != 1]
    assert not bad, f"{len(bad)} of 10 did not end in one call within {MAX_TOKENS}: {bad[:2]}"
    for (args,), _, _ in parsed:
        assert valid(args, ARGS) and compact(args), args


def test_compact_tags_take_only_compact_arguments() -> None:
    before = xg.Grammar.from_structural_tag(forced_call_tag())
    after = xg.Grammar.from_structural_tag(compact_structural_tag(forced_call_tag()))
    tight = calls_section(("get_weather", '{"city": "Rome", "days": 2}'))
    loose = calls_section(("get_weather", '{\n\t"city" :"Rome",  "days": 2 }'))
    extra = calls_section(("get_weather", '{"city": "Rome", "days": 2, "x": 1}'))
    assert accepts(after, tight) and not accepts(after, loose)
    assert accepts(before, tight) and accepts(before, loose)
    assert not accepts(after, extra) and not accepts(before, extra)  # strict, as before


def test_xml_styles_and_exclusions_are_left_as_written() -> None:
    xml = {"type": "json_schema", "json_schema": ARGS, "style": "qwen_xml"}
    excluding = {"type": "json_schema", "json_schema": ARGS, "excludes": ["x"]}
    for content in (xml, excluding):
        tag = in_tag(content)
        assert json.loads(compact_structural_tag(json.dumps(tag))) == tag


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_dir(cached_tiny_checkpoint())


@pytest.mark.parametrize("any_whitespace", [False, True])
def test_any_whitespace_frees_every_json_kind(tokenizer: Tokenizer, any_whitespace: bool) -> None:
    compiler = GrammarCompiler(tokenizer, 129280, any_whitespace=any_whitespace)
    loose = '{ "city": "Rome",\n"days": 2}'
    args_content = {"type": "json_schema", "json_schema": ARGS}
    cases = {
        Constraint.json_schema(ARGS, strict=True): loose,
        Constraint(kind="json_object"): loose,
        Constraint(kind="structural_tag", text=json.dumps(in_tag(args_content))): f"<a>{loose}</a>",
    }
    for constraint, text in cases.items():
        matcher = xg.GrammarMatcher(compiler.compile(constraint))
        assert matcher.accept_string(text) == any_whitespace, constraint.kind


def _engine_config(*flags: str) -> EngineConfig:
    args = build_parser().parse_args(["generate", "--prompt", "x", *flags])
    return EngineConfig.from_args(args)


def test_disable_any_whitespace_is_on_unless_the_flag_turns_it_off() -> None:
    assert _engine_config().disable_any_whitespace
    assert _engine_config("--disable-any-whitespace").disable_any_whitespace
    assert not _engine_config("--no-disable-any-whitespace").disable_any_whitespace
