"""Configuration of one worker group (a prefill, decode or colocated replica)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from dsv3serve.engine.config import EngineConfig
from workers.protocol import Role


class WorkerConfig(BaseModel):
    """One replica's role, engine and KV-transfer settings, validated once."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    role: Role
    engine: EngineConfig
    kv_connector: Literal["shm", "torch_dist", "nixl", "mooncake"] = "shm"
    kv_connector_options: dict[str, Any] = {}
    # prefill: staged KV not pulled within this many seconds is freed
    kv_lease_s: float = Field(30.0, gt=0)
    # decode: lock the prompt's prefix cached here and reserve (and pull) only the rest;
    # False: reserve and pull every prompt page (the cache is still filled, never matched)
    decode_prefix_reuse: bool = True
    torch_threads: int | None = Field(None, ge=1, description="torch intra-op threads")
    # rank 0 of a group: a collective that waits longer (a rank died or hung) raises, the
    # engine fails its requests and the health check has the replica replaced; it also
    # bounds how far apart the ranks may finish loading (they agree on the KV capacity)
    group_timeout_s: float = Field(60.0, gt=0)
    # Fault injection for tests only: sleep this long before each prefill.
    test_prefill_delay_s: float = Field(0.0, ge=0)
    # Fault injection for tests only (decode): hold each KV pull this long before copying.
    test_receive_delay_s: float = Field(0.0, ge=0)
    test_reserve_delay_s: float = Field(0.0, ge=0)
    # Fault injection for tests only (decode): the first N KV range pulls (overlapped
    # transfer) fail as a broken transfer would.
    test_fail_range_pulls: int = Field(0, ge=0)

    @property
    def group_size(self) -> int:
        """Ranks (devices, placement group bundles) of the replica: ``engine.tp_size``."""
        return self.engine.tp_size

    @model_validator(mode="after")
    def _check_group(self) -> WorkerConfig:
        if self.role == "prefill" and self.engine.enable_dp_attention:
            raise ValueError(
                "engine.enable_dp_attention: a prefill group publishes KV from rank 0's pool, "
                "so it runs TP (dp_size 1) for now; DP attention is for decode and colocated "
                "groups"
            )
        return self
