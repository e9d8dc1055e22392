"""Hypothesis strategies for request bodies, drawn from a pydantic model's JSON schema.

Half the bodies are *plain*: every property present gets a modest value of its declared
type, so many requests are accepted and run on the engine. The other half are
*hostile*: values at the edges (ints past 64 bits, lone surrogates, huge floats), now
and then any JSON value at all (the wrong type), and sometimes an unknown field holding
a nested structure. Fields that set how many tokens are generated draw from a small set,
so accepted requests finish fast on the CPU engine.
"""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

Schema = dict[str, Any]
Strategies = dict[str, st.SearchStrategy[Any]]

EDGE_INTS = [-(2**63) - 1, -(2**63), -1, 0, 2**31, 2**63 - 1, 2**63, 2**64 - 1, 2**70]
EDGE_NUMBERS = [0, 1, -1e300, 1e300, 2**70]
EDGE_TEXT = ["", "\x00", "<｜end▁of▁sentence｜>", "🙂" * 3]
LONE_SURROGATES = ["\ud800", "a\udfffb", "\udbffA"]  # travel as \ud800-style escapes
BUDGET_FIELDS = ("max_tokens", "max_completion_tokens", "min_tokens")
SMALL_BUDGETS = st.sampled_from([1, 2, 3])
BAD_BUDGETS = st.sampled_from([-1, 0, 2**70, "3", 3.0, True])


def deep_json() -> st.SearchStrategy[bytes]:
    """Arrays nested 1 to 200,000 deep, as bytes."""
    return st.integers(1, 200_000).map(lambda depth: b"[" * depth + b"]" * depth)


def any_json(max_leaves: int = 8) -> st.SearchStrategy[Any]:
    """Any JSON value (no NaN: the stdlib encoder would write a bare ``NaN``)."""
    leaves = st.one_of(
        st.none(),
        st.booleans(),
        st.integers() | st.sampled_from(EDGE_INTS),
        st.floats(allow_nan=False, allow_infinity=False),
        st.text(max_size=8) | st.sampled_from(EDGE_TEXT + LONE_SURROGATES),
    )
    return st.recursive(
        leaves,
        lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner),
        max_leaves=max_leaves,
    )


def _scalar(kind: str | None, hostile: bool) -> st.SearchStrategy[Any]:
    plain: dict[str | None, st.SearchStrategy[Any]] = {
        "integer": st.integers(0, 8),
        "number": st.floats(0.05, 1.0),
        "boolean": st.booleans(),
        "string": st.text(max_size=24),
        "null": st.none(),
    }
    edges: dict[str | None, st.SearchStrategy[Any]] = {
        "integer": st.integers(-3, 40) | st.sampled_from(EDGE_INTS),
        "number": st.floats(-3, 3) | st.sampled_from(EDGE_NUMBERS),
        "string": st.sampled_from(EDGE_TEXT),
    }
    if kind not in plain:
        return any_json()
    if hostile and kind == "string":
        return st.one_of(plain[kind], edges[kind], st.sampled_from(LONE_SURROGATES))
    if hostile and kind in edges:
        return plain[kind] | edges[kind]
    return plain[kind]


def _typed(schema: Schema, defs: Schema, hostile: bool) -> st.SearchStrategy[Any]:
    if "$ref" in schema:
        return _typed(defs[schema["$ref"].rsplit("/", 1)[-1]], defs, hostile)
    if "anyOf" in schema:
        return st.one_of([_typed(option, defs, hostile) for option in schema["anyOf"]])
    if "const" in schema:
        return st.just(schema["const"])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    if schema.get("type") == "array":
        items = _typed(schema.get("items", {}), defs, hostile)
        return st.lists(items, min_size=0 if hostile else 1, max_size=4)
    if schema.get("type") == "object":
        return object_of(schema, defs, hostile)
    return _scalar(schema.get("type"), hostile)


def _field(name: str, schema: Schema, defs: Schema, hostile: bool) -> st.SearchStrategy[Any]:
    if name in BUDGET_FIELDS:
        return SMALL_BUDGETS | BAD_BUDGETS if hostile else SMALL_BUDGETS
    typed = _typed(schema, defs, hostile)
    return st.one_of(typed, typed, typed, typed, any_json()) if hostile else typed


def object_of(
    schema: Schema, defs: Schema, hostile: bool, overrides: Strategies | None = None
) -> st.SearchStrategy[dict[str, Any]]:
    """An object with its required properties and about a quarter of the optional ones.

    Hostile: about a third of the properties present get a hostile value (the rest stay
    plain, so the fault gets past the other checks), a required one may be missing, and
    an unknown property may hold a nested structure. ``overrides`` replace the plain
    strategies of the properties they name.
    """
    props: Schema = schema.get("properties", {})
    required = set(schema.get("required", []))
    plain = {name: _field(name, sub, defs, False) for name, sub in props.items()}
    plain |= overrides or {}
    rough = {name: _field(name, sub, defs, True) for name, sub in props.items()}

    @st.composite
    def build(draw: st.DrawFn) -> dict[str, Any]:
        body: dict[str, Any] = {}
        for name in props:
            if name in required:
                keep = not hostile or draw(st.integers(0, 19)) > 0
            else:
                keep = draw(st.integers(0, 3)) == 0
            if keep:
                corrupt = hostile and draw(st.integers(0, 2)) == 0
                body[name] = draw(rough[name] if corrupt else plain[name])
        if hostile and draw(st.integers(0, 4)) == 0:  # an unknown field, maybe nested
            body[draw(st.text(max_size=6))] = draw(any_json(max_leaves=30))
        return body

    return build()


def request_bodies(model_schema: Schema, model: str) -> st.SearchStrategy[dict[str, Any]]:
    """Plain or hostile bodies for a request model (``Model.model_json_schema()``) served
    as ``model``; ``max_tokens`` is 3 unless drawn."""
    defs = model_schema.get("$defs", {})
    names = {"model": st.sampled_from([model, model, "not-" + model])}
    prompts = st.text(min_size=1, max_size=24) | st.lists(st.integers(0, 1000), min_size=1)
    overrides = names | {"prompt": prompts}
    plain = object_of(model_schema, defs, False, overrides)
    hostile = object_of(model_schema, defs, True, overrides)
    return (plain | hostile).map(lambda body: {"max_tokens": 3} | _coherent(body))


def _coherent(body: dict[str, Any]) -> dict[str, Any]:
    """``stream_options`` comes with streaming (a hostile value may still break it)."""
    if "stream_options" in body and "stream" not in body:
        body["stream"] = True
    return body
