"""Structured output, logit_bias, min_tokens and echo through the OpenAI HTTP layer: real
uvicorn over the tiny engine, called with the official ``openai`` client."""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

import openai
import pytest
from openai_api_util import (
    CHAT,
    MODEL,
    Served,
    client_fixture,  # noqa: F401 (fixture client)
    served_fixture,  # noqa: F401 (fixture served)
    wait_idle,
)
from schema_cases import SCHEMAS, response_format, valid

N = 5


async def _chat_all(served: Served, requests: list[dict[str, Any]]) -> list[Any]:
    client = openai.AsyncOpenAI(
        base_url=served.url + "/v1", api_key="x", max_retries=0, timeout=300
    )
    async with client:
        calls = [client.chat.completions.create(model=MODEL, messages=CHAT, **r) for r in requests]
        return await asyncio.gather(*calls)


def chat_all(served: Served, requests: list[dict[str, Any]]) -> list[Any]:
    """The replies to ``requests``, sent concurrently (the engine batches them)."""
    return asyncio.run(_chat_all(served, requests))


SAMPLED = {"n": N, "temperature": 1.0, "max_tokens": 200}


# ---- structured output ---------------------------------------------------------------------
def test_json_schema_outputs_always_validate(served: Served) -> None:
    requests = [SAMPLED | {"response_format": response_format(s, i)} for i, s in enumerate(SCHEMAS)]
    replies = chat_all(served, requests + [SAMPLED | {"max_tokens": 40}])
    *constrained, free = replies
    for i, (schema, reply) in enumerate(zip(SCHEMAS, constrained, strict=True)):
        assert len(reply.choices) == N
        for choice in reply.choices:
            text = choice.message.content
            assert choice.finish_reason == "stop" and valid(text, schema), (i, text)
    # The same model without the constraint: not even one of the schemas' outputs.
    texts = [choice.message.content for choice in free.choices]
    assert not any(valid(text, schema) for text in texts for schema in SCHEMAS), texts
    wait_idle(served)


# Every keyword the issue names, at once; strings and arrays bounded so the random model
# ends its output (it never closes an unbounded string by itself).
FIVE_KEYWORDS = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "code": {"type": "string", "minLength": 4, "maxLength": 6},
        "score": {"type": "integer", "minimum": -5, "maximum": 7},
        "color": {"enum": ["red", "green", 3]},
        "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 2},
    },
    "required": ["name", "code", "score", "color", "tags"],
    "additionalProperties": False,
}
SEEDS = 20
# The quote tokens ('"', '":', '",', '"}', ' "') pulled up: the random tiny model then
# closes its strings; which tokens may come next is still the grammar's alone.
QUOTES = {4: 10, 3362: 10, 1760: 10, 62773: 10, 582: 10}


def seeded(fields: dict[str, Any]) -> list[dict[str, Any]]:
    """``fields`` at temperature 1, once per seed."""
    return [fields | {"temperature": 1.0, "max_tokens": 120, "seed": s} for s in range(SEEDS)]


def test_json_object_is_an_object_for_every_seed(served: Served) -> None:
    replies = chat_all(
        served, seeded({"response_format": {"type": "json_object"}, "logit_bias": QUOTES})
    )
    texts = [reply.choices[0].message.content for reply in replies]
    assert all(isinstance(json.loads(text), dict) for text in texts), texts
    assert any(json.loads(text) for text in texts), texts  # not only empty objects
    wait_idle(served)


def test_strict_schema_keywords_hold_for_every_seed(served: Served) -> None:
    replies = chat_all(served, seeded({"response_format": response_format(FIVE_KEYWORDS, 0)}))
    for reply in replies:
        text = reply.choices[0].message.content
        assert reply.choices[0].finish_reason == "stop" and valid(text, FIVE_KEYWORDS), text
    wait_idle(served)


def test_json_object_regex_and_ebnf(client: openai.OpenAI) -> None:
    greedy = {"model": MODEL, "messages": CHAT, "temperature": 0, "max_tokens": 30}
    as_object = client.chat.completions.create(
        response_format={"type": "json_object"}, **greedy
    ).choices[0]
    free = client.chat.completions.create(**greedy).choices[0].message.content
    assert as_object.message.content.startswith("{") and not free.startswith("{")
    regex = r"(yes|no)-[0-9]{2}"
    reply = client.chat.completions.create(
        **(greedy | {"n": 3, "temperature": 1.0}), extra_body={"regex": regex}
    )
    assert all(re.fullmatch(regex, c.message.content) for c in reply.choices), reply
    ebnf = 'root ::= ("cat" | "dog") " " [0-9] [0-9]'
    reply = client.completions.create(
        model=MODEL, prompt="pet:", n=3, temperature=1.0, extra_body={"ebnf": ebnf}
    )
    assert all(re.fullmatch("(cat|dog) [0-9]{2}", c.text) for c in reply.choices), reply


BAD_SCHEMA = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}
UNIQUE = {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}


@pytest.mark.parametrize(
    ("fields", "param", "says"),
    [
        # Grammars compile on the engine, whose refusals carry no param.
        ({"response_format": BAD_SCHEMA}, None, 'invalid json_schema: Unsupported type "objectx"'),
        ({"response_format": {"type": "json_schema"}}, "response_format", "json_schema must"),
        (
            {
                "response_format": response_format(
                    {"type": "object", "properties": {"ids": UNIQUE}}, 0
                )
            },
            "response_format",
            "invalid response_format: 'uniqueItems' is not supported (at #/properties/ids)",
        ),
        ({"response_format": {"type": "xml"}}, "response_format", "'json_schema'"),
        ({"extra_body": {"regex": "a(b"}}, None, "invalid regex: Regex parsing error"),
        ({"extra_body": {"ebnf": "root ::= x"}}, None, "invalid ebnf: EBNF parser error"),
        (
            {"response_format": {"type": "json_object"}, "extra_body": {"regex": "a"}},
            "regex",
            "at most one of response_format, regex",
        ),
        (
            {"response_format": {"type": "json_object"}, "extra_body": {"min_tokens": 2}},
            "min_tokens",
            "cannot be combined with a structured-output constraint",
        ),
        ({"logit_bias": {"7": 101}}, "logit_bias", "[-100, 100]"),
        ({"logit_bias": {"129280": 5}}, "logit_bias", "token ids must be in [0, 129280)"),
        ({"logit_bias": {"seven": 5}}, "logit_bias", "valid integer"),
    ],
)
def test_bad_controls_are_400(
    client: openai.OpenAI, fields: dict[str, Any], param: str | None, says: str
) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4, **fields)
    error = info.value.body
    assert says in error["message"] and error["param"] == param, error


# ---- logit_bias and min_tokens -----------------------------------------------------------------
def test_logit_bias_bans_and_forces_tokens(served: Served, client: openai.OpenAI) -> None:
    tok = served.engine.tokenizer
    reply = client.completions.create(model=MODEL, prompt="The sea", max_tokens=6, temperature=0)
    first = tok.encode(reply.choices[0].text, add_bos=False)[0]
    banned = client.completions.create(
        model=MODEL, prompt="The sea", max_tokens=6, temperature=0, logit_bias={str(first): -100}
    )
    assert banned.choices[0].text != reply.choices[0].text
    assert tok.encode(banned.choices[0].text, add_bos=False)[0] != first
    forced_id = tok.encode(" whale", add_bos=False)[0]
    for temperature in (0.0, 1.0):
        forced = client.completions.create(
            model=MODEL,
            prompt="The sea",
            max_tokens=4,
            temperature=temperature,
            logit_bias={str(forced_id): 100},
        )
        assert forced.choices[0].text == tok.decode([forced_id] * 4)


def test_min_tokens_holds_back_the_end(served: Served, client: openai.OpenAI) -> None:
    eos = {str(served.engine.tokenizer.eos_token_id): 100}  # EOS wins whenever allowed
    kw = {"model": MODEL, "messages": CHAT, "max_tokens": 20, "logit_bias": eos}
    at_once = client.chat.completions.create(**kw)
    held = client.chat.completions.create(**kw, extra_body={"min_tokens": 5})
    assert at_once.usage.completion_tokens == 1 and at_once.choices[0].finish_reason == "stop"
    assert held.usage.completion_tokens == 6 and held.choices[0].finish_reason == "stop"


# ---- echo ----------------------------------------------------------------------------------------
def test_completions_echo(client: openai.OpenAI) -> None:
    kw = {"model": MODEL, "max_tokens": 5, "temperature": 0}
    plain = client.completions.create(prompt="The sea is", **kw).choices[0].text
    echoed = client.completions.create(prompt="The sea is", echo=True, **kw).choices[0].text
    assert echoed == "The sea is" + plain
    stream = client.completions.create(prompt="The sea is", echo=True, stream=True, **kw)
    assert "".join(c.choices[0].text for c in stream if c.choices) == echoed
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(prompt="The sea is", echo=True, logprobs=1, **kw)
    assert info.value.body["param"] == "echo" and "prompt's logprobs" in info.value.body["message"]
