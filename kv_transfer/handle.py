"""The KV handle: what the prefill side tells the decode side about staged KV pages.

Plain pydantic (no torch), so the router can carry it between workers. It crosses
process boundaries as JSON, validated on arrival; never pickled by us.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class KVHandle(BaseModel):
    """Staged KV of one prefilled request, enough for a receiver to pull it.

    ``source`` is connector-specific (a shared-memory name, a peer address); only the
    connector that made the handle reads it. ``first_page``: the index, among the prompt's
    pages, of the first staged page: the decode side holds the pages before it (its prefix
    cache), and the staged pages hold the ``num_tokens`` prompt tokens after them.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    request_id: str
    connector: str
    num_tokens: int = Field(ge=1)
    num_pages: int = Field(ge=1)
    page_size: int = Field(ge=1)
    num_layers: int = Field(ge=1)
    kv_dim: int = Field(ge=1)
    dtype: str  # torch dtype name of the pool storage, e.g. "bfloat16", "float8_e4m3fn"
    nbytes: int = Field(ge=0)
    source: dict[str, Any] = {}
    first_page: int = Field(0, ge=0)


class TransferStats(BaseModel):
    """What one completed transfer moved and how long it took."""

    model_config = ConfigDict(frozen=True)

    request_id: str
    nbytes: int
    seconds: float

    @property
    def gbps(self) -> float:
        """Gigabytes (1e9 bytes) per second."""
        return self.nbytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


class TransferError(RuntimeError):
    """A transfer that could not complete (peer gone, lease expired, shape mismatch)."""
