"""The types of JSON data as Python holds it after ``json.loads`` (or before ``json.dumps``).

Used where a value is a JSON document: HTTP and gRPC bodies, ``config.json`` fields, KV
handle sources, wire messages and metric snapshots. Annotations only (the aliases are
strings, so they cost nothing at run time and recurse for a type checker).
"""

from __future__ import annotations

from typing import TypeAlias

__all__ = ["JSONObject", "JSONValue"]

JSONValue: TypeAlias = "str | int | float | bool | None | list[JSONValue] | dict[str, JSONValue]"
JSONObject: TypeAlias = "dict[str, JSONValue]"
