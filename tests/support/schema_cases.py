"""JSON schemas for the structured-output tests, and how to check outputs against them.

Every string is bounded (``maxLength``, ``enum`` or ``pattern``) and every array has
``maxItems``: the tiny random model never chooses to close an unbounded string, so an
unbounded one would only show ``max_tokens``, not the constraint.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import jsonschema
import openai

_NAME = {"type": "string", "maxLength": 6}
_AGE = {"type": "integer", "minimum": 0, "maximum": 130}


def _obj(props: dict[str, Any], required: list[str] | None = None) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": props,
        "required": list(props) if required is None else required,
        "additionalProperties": False,
    }


SCHEMAS: list[dict[str, Any]] = [
    _obj({"name": _NAME}),
    _obj({"age": _AGE}),
    _obj({"ok": {"type": "boolean"}}),
    _obj({"color": {"enum": ["red", "green", "blue"]}}),
    _obj({"score": {"type": "number", "minimum": 0, "maximum": 1}}),
    _obj({"temp": {"type": "number", "minimum": -40.5, "maximum": 60}}),
    _obj({"n": {"type": "integer", "minimum": 10, "maximum": 99}}),
    _obj({"tags": {"type": "array", "items": _NAME, "maxItems": 3}}),
    _obj({"ids": {"type": "array", "items": _AGE, "minItems": 1, "maxItems": 4}}),
    _obj({"user": _obj({"name": _NAME, "age": _AGE})}),
    _obj({"a": _obj({"b": _obj({"c": {"type": "boolean"}})})}),
    _obj({"points": {"type": "array", "items": _obj({"x": _AGE, "y": _AGE}), "maxItems": 2}}),
    _obj({"kind": {"const": "circle"}, "r": {"type": "number", "minimum": 0, "maximum": 10}}),
    _obj({"status": {"enum": ["ok", "error", 3, None]}}),
    _obj({"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}}),
    _obj({"maybe": {"anyOf": [_AGE, {"type": "null"}]}}),
    _obj({"first": _NAME, "last": _NAME, "nick": _NAME}, required=["first"]),
    {"type": "array", "items": {"enum": ["x", "y"]}, "minItems": 2, "maxItems": 3},
    _obj(
        {
            "matrix": {
                "type": "array",
                "items": {"type": "array", "items": _AGE, "maxItems": 2},
                "maxItems": 2,
            }
        }
    ),  # fmt: skip
    _obj(
        {
            "order": _obj(
                {
                    "id": {"type": "integer", "minimum": 1, "maximum": 9999},
                    "items": {"type": "array", "items": {"enum": ["tea", "cake"]}, "maxItems": 3},
                    "paid": {"type": "boolean"},
                }
            )
        }
    ),
]


def valid(text: str, schema: dict[str, Any]) -> bool:
    """Whether ``text`` parses as JSON and validates against ``schema``."""
    try:
        jsonschema.validate(json.loads(text), schema)
    except (json.JSONDecodeError, jsonschema.ValidationError):
        return False
    return True


def response_format(schema: dict[str, Any], index: int) -> dict[str, Any]:
    """OpenAI's ``response_format`` for ``schema``, strict."""
    return {
        "type": "json_schema",
        "json_schema": {"name": f"case_{index}", "schema": schema, "strict": True},
    }


async def _constrained_replies(base_url: str, model: str, n: int) -> list[Any]:
    client = openai.AsyncOpenAI(base_url=base_url, api_key="x", max_retries=0, timeout=600)
    async with client:
        calls = [
            client.chat.completions.create(
                model=model,
                messages=[{"role": "user", "content": "Describe it as JSON."}],
                n=n,
                temperature=1.0,
                max_tokens=200,
                response_format=response_format(schema, i),
            )
            for i, schema in enumerate(SCHEMAS)
        ]
        return await asyncio.gather(*calls)


def invalid_outputs(base_url: str, model: str, n: int) -> list[tuple[int, str, str | None]]:
    """Sends every schema of SCHEMAS at once (``n`` samples each, temperature 1) to the
    OpenAI server at ``base_url``; returns (schema index, text, finish reason) of each
    output that is not valid JSON of its schema, ended by the schema's end."""
    replies = asyncio.run(_constrained_replies(base_url, model, n))
    bad = []
    for i, (schema, reply) in enumerate(zip(SCHEMAS, replies, strict=True)):
        assert len(reply.choices) == n
        for choice in reply.choices:
            text, reason = choice.message.content, choice.finish_reason
            if reason != "stop" or not valid(text, schema):
                bad.append((i, text, reason))
    return bad
