"""The types of JSON data as Python holds it after ``json.loads`` (or before ``json.dumps``),
and checked readers that narrow a value to the type the reader needs.

Used where a value is a JSON document: HTTP and gRPC bodies, ``config.json`` fields, KV
handle sources, wire messages and metric snapshots. The aliases are strings (they cost
nothing at run time and recurse for a type checker); a reader raises TypeError naming the
value when it is not of the expected JSON type.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TypeAlias

__all__ = [
    "JSONObject",
    "JSONValue",
    "json_float",
    "json_int",
    "json_list",
    "json_object",
    "json_str",
]

# Nested arrays and objects are read-only views, so a ``list[int]`` or ``dict[str, str]`` is a
# JSONValue as it stands; a reader (``json_list``, ``json_object``) gives the mutable form.
JSONValue: TypeAlias = (
    "str | int | float | bool | None | Sequence[JSONValue] | Mapping[str, JSONValue]"
)
JSONObject: TypeAlias = "dict[str, JSONValue]"


def _mismatch(what: str, expected: str, value: JSONValue) -> TypeError:
    return TypeError(f"expected {what} to be {expected}, got {type(value).__name__} {value!r:.80}")


def json_object(value: JSONValue, what: str) -> JSONObject:
    """``value`` as a JSON object; TypeError naming ``what`` for anything else."""
    if not isinstance(value, dict):
        raise _mismatch(what, "a JSON object", value)
    return value


def json_list(value: JSONValue, what: str) -> list[JSONValue]:
    """``value`` as a JSON array; TypeError naming ``what`` for anything else."""
    if not isinstance(value, list):
        raise _mismatch(what, "a JSON array", value)
    return value


def json_int(value: JSONValue, what: str) -> int:
    """``value`` as an integer (a bool is one, as in Python); TypeError for anything else."""
    if not isinstance(value, int):
        raise _mismatch(what, "an integer", value)
    return value


def json_float(value: JSONValue, what: str) -> float:
    """``value`` (a JSON number, or a string ``float()`` reads) as a float."""
    if not isinstance(value, (str, int, float)):
        raise _mismatch(what, "a number", value)
    return float(value)


def json_str(value: JSONValue, what: str) -> str:
    """``value`` as a string; TypeError naming ``what`` for anything else."""
    if not isinstance(value, str):
        raise _mismatch(what, "a string", value)
    return value
