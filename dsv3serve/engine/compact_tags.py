"""Structural tags whose JSON is compact: no free whitespace between JSON elements.

xgrammar 0.2.9 compiles a structural tag's ``json_schema`` content with any whitespace
between elements (``max_whitespace_cnt`` bounds each run, at least 1 character); a random
or weak model then spends its ``max_tokens`` on whitespace inside tool-call arguments.
:func:`compact_structural_tag` replaces each such content by a ``grammar`` content: the
EBNF xgrammar writes for the same schema with ``any_whitespace=False`` (separators
``", "`` and ``": "``, nothing else outside strings), as ``json_schema`` and
``json_object`` constraints compile. Contents in another ``style`` (the XML forms) or with
``excludes`` are left as written, and so is the legacy form (``structures`` / ``triggers``).
"""

from __future__ import annotations

import json

from dsv3serve.json_types import JSONValue


def compact_structural_tag(text: str) -> str:
    """The structural tag ``text`` (JSON) with every plain ``json_schema`` content
    compact; raises ValueError (invalid JSON) or RuntimeError (a schema xgrammar refuses)."""
    return json.dumps(_compact(json.loads(text)), ensure_ascii=False)


def _compact(node: JSONValue) -> JSONValue:
    if isinstance(node, list):
        return [_compact(item) for item in node]
    if not isinstance(node, dict):
        return node
    if node.get("type") == "json_schema" and "json_schema" in node:
        return _grammar_content(node) if _plain(node) else node
    return {key: _compact(value) for key, value in node.items()}


def _plain(content: dict[str, JSONValue]) -> bool:
    """A JSON-style content without exclusions: its EBNF form means the same."""
    return content.get("style", "json") == "json" and not content.get("excludes")


def _grammar_content(content: dict[str, JSONValue]) -> JSONValue:
    """The ``grammar`` content matching ``content``'s schema compactly. Strict, as xgrammar
    compiles a tag's ``json_schema`` (properties the schema lists, no others)."""
    import xgrammar

    grammar = xgrammar.Grammar.from_json_schema(
        json.dumps(content["json_schema"]),
        any_whitespace=False,
        strict_mode=True,
        any_order=bool(content.get("any_order", False)),
    )
    return {"type": "grammar", "grammar": str(grammar)}
