"""JSON Schema keywords and the grammar: each keyword the server accepts is enforced by
the compiled grammar (it takes a valid instance and refuses one that breaks only that
keyword), and each keyword the grammar drops is refused with an error naming it.

The grammar is compiled as ``engine/grammar.py`` compiles a strict ``json_schema``
(compact JSON); instances are checked as whole strings, so no model is involved. A
refused keyword's case also shows the grammar taking the breaking instance: when a new
xgrammar starts enforcing it, the test says so and the keyword can be allowed.
"""

from __future__ import annotations

import json
import re
from typing import Any

import jsonschema
import pytest
import xgrammar

from dsv3serve.sampling.constraint import Constraint
from dsv3serve.sampling.schema_support import schema_problem

STR = {"type": "string"}
INTS = {"type": "array", "items": {"type": "integer"}}
EMAIL = STR | {"format": "email"}
REF = {"$defs": {"s": STR}, "$ref": "#/$defs/s"}
OBJ_AB = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}
ANY_INTS = {"additionalProperties": {"type": "integer"}}
AB = {"a": {"type": "integer"}, "b": {"type": "integer"}}

# keyword: (schema, an instance it allows, an instance that breaks only that keyword)
ENFORCED: dict[str, tuple[dict[str, Any], Any, Any]] = {
    "type": ({"type": "integer"}, 3, "3"),
    "type list": ({"type": ["integer", "null"]}, None, "x"),
    "enum": ({"enum": ["a", "b", 3]}, 3, "c"),
    "const": ({"const": "a"}, "a", "b"),
    "minLength": (STR | {"minLength": 3}, "abc", "ab"),
    "maxLength": (STR | {"maxLength": 3}, "abc", "abcd"),
    "pattern": (STR | {"pattern": "^a+$"}, "aa", "ab"),
    "format": (STR | {"format": "date"}, "2026-11-28", "28/11/2026"),
    "minimum": ({"type": "number", "minimum": 1.5}, 1.5, 1.25),
    "maximum": ({"type": "integer", "maximum": 5}, 5, 6),
    "exclusiveMinimum": ({"type": "integer", "exclusiveMinimum": 5}, 6, 5),
    "exclusiveMaximum": ({"type": "number", "exclusiveMaximum": 1.5}, 1.25, 1.5),
    "multipleOf": ({"type": "integer", "multipleOf": 3}, 6, 7),
    "items": (INTS, [1], ["a"]),
    "minItems": (INTS | {"minItems": 2}, [1, 2], [1]),
    "maxItems": (INTS | {"maxItems": 2}, [1, 2], [1, 2, 3]),
    "prefixItems": ({"type": "array", "prefixItems": [STR], "items": False}, ["a"], ["a", 1]),
    "required": ({"type": "object", "properties": AB, "required": ["a"]}, {"a": 1}, {"b": 1}),
    "additionalProperties": (
        {"type": "object", "properties": AB, "additionalProperties": False},
        {"a": 1},
        {"c": 1},
    ),
    "propertyNames": (
        {"type": "object", "propertyNames": STR | {"maxLength": 1}, "additionalProperties": True},
        {"a": 1},
        {"ab": 1},
    ),
    "minProperties": ({"type": "object", "minProperties": 1} | ANY_INTS, {"a": 1}, {}),
    "maxProperties": (
        {"type": "object", "maxProperties": 1} | ANY_INTS,
        {"a": 1},
        {"a": 1, "b": 2},
    ),
    "anyOf": ({"anyOf": [{"type": "integer"}, {"type": "null"}]}, None, "x"),
    "oneOf": ({"oneOf": [{"type": "integer"}, STR | {"maxLength": 1}]}, "a", "ab"),
    "allOf": ({"allOf": [{"type": "integer", "maximum": 5}]}, 5, 6),
    "$ref": ({"$defs": {"s": STR | {"maxLength": 1}}, "$ref": "#/$defs/s"}, "a", "ab"),
}

# keyword named in the refusal: (schema, an instance it allows, one that breaks it)
REFUSED: dict[str, tuple[dict[str, Any], Any, Any]] = {
    "uniqueItems": (INTS | {"uniqueItems": True}, [1, 2], [1, 1]),
    "contains": (INTS | {"contains": {"const": 5}}, [5], [1]),
    "maxContains": (INTS | {"maxContains": 1, "contains": {"const": 5}}, [5], [5, 5]),
    "not": ({"type": "integer", "not": {"const": 3}}, 2, 3),
    "if": ({"type": "integer", "if": {"minimum": 3}, "then": {"maximum": 5}}, 4, 7),
    "dependentRequired": (
        {"type": "object", "properties": AB, "dependentRequired": {"a": ["b"]}},
        {"a": 1, "b": 2},
        {"a": 1},
    ),
    "allOf": (
        {"allOf": [{"type": "integer", "minimum": 0}, {"type": "integer", "maximum": 5}]},
        3,
        9,
    ),
    "oneOf": ({"oneOf": [{"type": "integer"}, {"type": "integer", "minimum": 3}]}, 1, 4),
    "multipleOf": ({"type": "number", "multipleOf": 0.5}, 1.5, 1.25),
    "maxLength' together with 'pattern": (STR | {"pattern": "^a+$", "maxLength": 2}, "a", "aaa"),
    "maxLength' together with 'format": (EMAIL | {"maxLength": 6}, "a@b.co", "a@bc.de"),
    "format' 'idn-email": (STR | {"format": "idn-email"}, "a@b.co", "no"),
    "maxLength' without a 'type": ({"maxLength": 2}, "ab", "abc"),
    "maximum' without a 'type": ({"maximum": 5}, 5, 6),
    "maxLength' beside '$ref": (REF | {"maxLength": 1}, "a", "ab"),
    "maxLength' beside 'anyOf": ({"maxLength": 2, "anyOf": [STR, {"type": "null"}]}, "a", "abc"),
    "maxLength' beside 'enum": (STR | {"enum": ["abcd", "a"], "maxLength": 2}, "a", "abcd"),
    "enum' holds a value whose type": (STR | {"enum": ["a", 1]}, "a", 1),
    "required' names 'c'": (OBJ_AB | {"required": ["a", "c"]}, None, {"a": 1}),
}  # fmt: skip


def valid(schema: dict[str, Any], instance: Any) -> bool:
    """Whether ``instance`` validates against ``schema`` (formats checked too)."""
    checker = jsonschema.Draft202012Validator.FORMAT_CHECKER
    return jsonschema.Draft202012Validator(schema, format_checker=checker).is_valid(instance)


def accepts(schema: dict[str, Any], instance: Any) -> bool:
    """Whether the grammar of ``schema`` (compiled as the server compiles it) takes
    ``instance`` written as compact JSON."""
    grammar = xgrammar.Grammar.from_json_schema(
        json.dumps(schema), any_whitespace=False, strict_mode=True
    )
    compiled = xgrammar.GrammarCompiler(xgrammar.TokenizerInfo([])).compile_grammar(grammar)
    matcher = xgrammar.GrammarMatcher(compiled, terminate_without_stop_token=True)
    return matcher.accept_string(json.dumps(instance)) and matcher.is_terminated()


@pytest.mark.parametrize("keyword", list(ENFORCED))
def test_enforced_keywords_hold_in_the_grammar(keyword: str) -> None:
    schema, good, bad = ENFORCED[keyword]
    assert valid(schema, good) and not valid(schema, bad)
    assert schema_problem(schema) is None
    # content keywords annotate in JSON Schema; a client asking for base64 gets a refusal
    assert "'contentEncoding'" in str(schema_problem(STR | {"contentEncoding": "base64"}))
    assert accepts(schema, good) and not accepts(schema, bad)


@pytest.mark.parametrize("keyword", list(REFUSED))
def test_dropped_keywords_are_refused_by_name(keyword: str) -> None:
    schema, good, bad = REFUSED[keyword]
    assert not valid(schema, bad)
    assert accepts(schema, bad), f"the grammar now enforces {keyword}: allow it"
    with pytest.raises(ValueError, match=re.escape(f"'{keyword}")) as info:
        Constraint.json_schema({"type": "object", "properties": {"x": schema}})
    assert "(at #/properties/x)" in str(info.value)


def test_annotations_and_unknown_keywords_are_accepted() -> None:
    schema = {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": "T",
        "description": "d",
        "type": "object",
        "properties": {"a": {"type": "integer", "default": 1, "examples": [2], "x-note": "n"}},
        "required": ["a"],
    }
    assert schema_problem(schema) is None
    # content keywords annotate in JSON Schema; a client asking for base64 gets a refusal
    assert "'contentEncoding'" in str(schema_problem(STR | {"contentEncoding": "base64"}))
