"""A request's structured-output constraint: what its output must match (torch-free).

A :class:`Constraint` is a plain spec (kind + text) carried in ``SamplingParams`` from the
router to the engine, where ``engine/grammar.py`` compiles it with xgrammar into a token
mask applied at every sampling step. Kinds, with what ``text`` holds:

- ``json_schema``: a JSON Schema document (OpenAI ``response_format.json_schema.schema``);
  ``strict`` disallows properties and items the schema does not list; a schema using a
  keyword the grammar would not enforce is refused (``engine/schema_support.py``);
- ``json_object``: any JSON object (``text`` empty), written compactly;
- ``regex``: a regular expression the whole output matches (SGLang's ``regex``);
- ``ebnf``: an EBNF grammar whose start rule is ``root`` (SGLang's ``ebnf``, GBNF syntax);
- ``structural_tag``: an xgrammar structural tag (JSON): free text with constrained
  segments, e.g. tool calls between begin/end tags.

The output ends when the constraint's structure is complete: the mask then allows only
the end-of-sequence token.
"""

from __future__ import annotations

import json
from typing import Literal

from pydantic import BaseModel, ConfigDict, model_validator

from dsv3serve.sampling.schema_support import schema_problem

ConstraintKind = Literal["json_schema", "json_object", "regex", "ebnf", "structural_tag"]
_JSON_KINDS = ("json_schema", "structural_tag")


class Constraint(BaseModel):
    """What the output of one request must match; see the module docstring."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: ConstraintKind
    text: str = ""
    strict: bool = False

    @model_validator(mode="after")
    def _check_text(self) -> Constraint:
        if self.kind == "json_object":
            if self.text:
                raise ValueError(f"json_object takes no text, got {self.text[:40]!r}")
            return self
        if not self.text.strip():
            raise ValueError(f"{self.kind} needs a non-empty text")
        if self.kind in _JSON_KINDS:
            value = _check_json_object(self.kind, self.text)
            problem = schema_problem(value) if self.kind == "json_schema" else None
            if problem is not None:
                raise ValueError(problem)
        return self

    @classmethod
    def json_schema(cls, schema: dict, strict: bool = False) -> Constraint:
        """A ``json_schema`` constraint from a schema given as a dict."""
        return cls(kind="json_schema", text=json.dumps(schema), strict=strict)


def _check_json_object(kind: str, text: str) -> dict:
    """``text`` parsed; ValueError unless it is a JSON object."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{kind} is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{kind} must be a JSON object, got {type(value).__name__}")
    return value
