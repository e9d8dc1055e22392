"""Which JSON Schema keywords the structured-output grammar enforces (torch-free).

xgrammar (``engine/grammar.py``) compiles a schema into a grammar, but it drops some
keywords without an error: the output then satisfies the grammar and not the schema.
:func:`schema_problem` finds the first such keyword so the request is refused with a 400
that names it, before any work. What is enforced (checked keyword by keyword in
``tests/sampling/test_schema_support.py``): ``type`` (one or a list), ``enum``, ``const``,
``properties``, ``required``, ``additionalProperties``, ``unevaluatedProperties``,
``propertyNames``, ``minProperties``, ``maxProperties``, ``items``, ``prefixItems``,
``unevaluatedItems``, ``minItems``, ``maxItems``, ``minLength``, ``maxLength``,
``pattern``, the formats in :data:`FORMATS`, ``minimum``, ``maximum``,
``exclusiveMinimum``, ``exclusiveMaximum``, ``multipleOf`` (integers), ``anyOf``,
``oneOf`` (branches of distinct types), ``allOf`` (one branch), ``$ref`` / ``$defs``.
Annotations (``title``, ``description``, ``default``, ``examples``, ...) and keywords no
JSON Schema draft defines assert nothing, so they are accepted as validators accept them.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

JSONSchema = dict[str, Any]

FORMATS = frozenset(
    {
        "date", "time", "date-time", "duration", "email", "hostname", "ipv4", "ipv6",
        "uri", "uri-reference", "uri-template", "uuid", "json-pointer",
        "relative-json-pointer",
    }
)  # fmt: skip
_NEVER = {
    "not": "negation",
    "if": "conditional subschemas",
    "then": "conditional subschemas",
    "else": "conditional subschemas",
    "dependentRequired": "dependencies between properties",
    "dependentSchemas": "dependencies between properties",
    "dependencies": "dependencies between properties",
    "contains": "contains constraints",
    "minContains": "contains constraints",
    "maxContains": "contains constraints",
    "patternProperties": "pattern-named properties",
    "additionalItems": "the draft-7 tuple form (use prefixItems)",
    "$dynamicRef": "dynamic references",
    "$recursiveRef": "dynamic references",
    "contentEncoding": "content encodings",
    "contentMediaType": "content media types",
    "contentSchema": "content media types",
}
_BY_TYPE = {
    "string": ("minLength", "maxLength", "pattern", "format"),
    "number": ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"),
    "array": ("items", "prefixItems", "minItems", "maxItems", "uniqueItems", "unevaluatedItems"),
}
_TYPED = {name for names in _BY_TYPE.values() for name in names}
_OBJECT = ("properties", "required", "additionalProperties", "minProperties", "maxProperties")
_ASSERTING = _TYPED | set(_OBJECT) | {"propertyNames", "unevaluatedProperties", "type"}
_COMPOSED = ("anyOf", "oneOf", "allOf", "$ref")
_CHILD_MAPS = ("properties", "$defs", "definitions")
_CHILDREN = ("items", "additionalProperties", "propertyNames", "unevaluatedProperties")
_CHILD_LISTS = ("prefixItems", "anyOf", "oneOf", "allOf")


def schema_problem(schema: object) -> str | None:
    """Why the grammar would not enforce ``schema`` (naming the keyword and where it is,
    e.g. ``#/properties/tags``), or None when it enforces all of it."""
    for path, node in _subschemas(schema, "#"):
        problem = _node_problem(node)
        if problem is not None:
            return f"{problem} (at {path}); this server's grammar would not enforce it"
    return None


def _subschemas(node: object, path: str) -> Iterator[tuple[str, JSONSchema]]:
    """Every schema object inside ``node`` (itself first) with its JSON pointer."""
    if not isinstance(node, dict):
        return
    yield path, node
    for key in _CHILD_MAPS:
        children = node.get(key)
        if isinstance(children, dict):
            for name, child in children.items():
                yield from _subschemas(child, f"{path}/{key}/{name}")
    for key in _CHILDREN:
        yield from _subschemas(node.get(key), f"{path}/{key}")
    for key in _CHILD_LISTS:
        children = node.get(key)
        if isinstance(children, list):
            for i, child in enumerate(children):
                yield from _subschemas(child, f"{path}/{key}/{i}")


def _node_problem(node: JSONSchema) -> str | None:
    never = next((key for key in node if key in _NEVER), None)
    if never is not None:
        return f"'{never}' is not supported: {_NEVER[never]} cannot be enforced"
    checks = (_unique_items, _composition, _untyped, _length_beside_pattern, _multiple_of)
    for check in (*checks, _format, _enum_siblings, _required_undeclared):
        problem = check(node)
        if problem is not None:
            return problem
    return None


def _unique_items(node: JSONSchema) -> str | None:
    if node.get("uniqueItems") not in (None, False):
        return "'uniqueItems' is not supported"
    return None


def _composition(node: JSONSchema) -> str | None:
    allof = node.get("allOf")
    if isinstance(allof, list) and len(allof) > 1:
        return "'allOf' with more than one schema is not supported (merge them)"
    oneof = node.get("oneOf")
    if isinstance(oneof, list) and not _distinct_types(oneof):
        return "'oneOf' whose branches are not of distinct types is not supported (use anyOf)"
    composed = [key for key in _COMPOSED if key in node]
    beside = sorted(key for key in node if key in _ASSERTING)
    if composed and beside:
        return f"'{beside[0]}' beside '{composed[0]}' is not supported (move it into it)"
    return None


def _distinct_types(branches: list[Any]) -> bool:
    seen: set[str] = set()
    for branch in branches:
        types = _types(branch) if isinstance(branch, dict) else set()
        if "integer" in types:
            types.add("number")  # every integer is a number
        if not types or types & seen:
            return False
        seen |= types
    return True


def _types(node: JSONSchema) -> set[str]:
    given = node.get("type")
    return {given} if isinstance(given, str) else set(given or [])


def _untyped(node: JSONSchema) -> str | None:
    if "type" in node or "enum" in node or "const" in node:
        return None
    loose = next((key for key in node if key in _TYPED), None)
    if loose is not None:
        return f"'{loose}' without a 'type' is not supported (add the type it applies to)"
    return None


def _length_beside_pattern(node: JSONSchema) -> str | None:
    length = next((key for key in ("minLength", "maxLength") if key in node), None)
    shape = next((key for key in ("pattern", "format") if key in node), None)
    if length and shape:
        return f"'{length}' together with '{shape}' is not supported (fold it into a pattern)"
    return None


def _multiple_of(node: JSONSchema) -> str | None:
    value = node.get("multipleOf")
    if value is None:
        return None
    if node.get("type") != "integer" or not isinstance(value, int) or isinstance(value, bool):
        return "'multipleOf' is supported for type 'integer' with an integer value only"
    return None


def _format(node: JSONSchema) -> str | None:
    value = node.get("format")
    if value is not None and value not in FORMATS:
        return f"'format' {value!r} is not supported (supported: {', '.join(sorted(FORMATS))})"
    return None


def _enum_siblings(node: JSONSchema) -> str | None:
    key = "enum" if "enum" in node else "const" if "const" in node else None
    if key is None:
        return None
    beside = sorted(name for name in node if name in _ASSERTING and name != "type")
    if beside:
        return f"'{beside[0]}' beside '{key}' is not supported (list only allowed values)"
    values = node["enum"] if key == "enum" else [node["const"]]
    allowed = _types(node)
    if allowed and isinstance(values, list) and not all(_fits(v, allowed) for v in values):
        return f"'{key}' holds a value whose type 'type' does not allow"
    return None


def _fits(value: object, types: set[str]) -> bool:
    kind = _json_type(value)
    return kind in types or (kind == "integer" and "number" in types)


def _json_type(value: object) -> str:
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    names = {float: "number", str: "string", list: "array", dict: "object", type(None): "null"}
    return names.get(type(value), "unknown")


def _required_undeclared(node: JSONSchema) -> str | None:
    required, declared = node.get("required"), node.get("properties")
    if not isinstance(required, list):
        return None
    missing = [name for name in required if name not in (declared or {})]
    if missing:
        return f"'required' names {missing[0]!r}, which 'properties' does not declare"
    return None
