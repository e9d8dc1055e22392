"""The base of every OpenAI request-body model: strict types, unknown fields ignored, and an
explicit ``null`` meaning "not given" (as vLLM reads bodies)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, model_validator


class RequestPart(BaseModel):
    """A request body or a part of one; see the module docstring."""

    model_config = ConfigDict(extra="ignore", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _drop_nulls(cls, data: Any) -> Any:
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None}
        return data
