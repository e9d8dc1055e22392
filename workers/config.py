"""Configuration of one worker group (a prefill, decode or colocated replica)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from dsv3serve.engine.config import EngineConfig
from workers.protocol import Role


class WorkerConfig(BaseModel):
    """One replica's role, engine and KV-transfer settings, validated once."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    role: Role
    engine: EngineConfig
    kv_connector: Literal["shm", "torch_dist", "nixl"] = "shm"
    kv_connector_options: dict[str, Any] = {}
    # prefill: staged KV not pulled within this many seconds is freed
    kv_lease_s: float = Field(30.0, gt=0)
    torch_threads: int | None = Field(None, ge=1, description="torch intra-op threads")
    # ranks of the group: one engine over group_size devices (placement group bundles)
    group_size: int = Field(1, ge=1)
    # Fault injection for tests only: sleep this long before each prefill.
    test_prefill_delay_s: float = Field(0.0, ge=0)

    @field_validator("group_size")
    @classmethod
    def _one_rank_with_speculation(cls, group_size: int, info: ValidationInfo) -> int:
        """Speculative decoding runs on one rank: a lockstep group of N ranks broadcasts
        each step's spans and imported pages, not the draft chain or its state."""
        engine = info.data.get("engine")
        algorithm = None if engine is None else engine.speculative_algorithm
        if algorithm is not None and group_size > 1:
            raise ValueError(
                f"found {group_size} with engine.speculative_algorithm {algorithm}, expected "
                "group_size 1 (a multi-rank group does not broadcast the draft state yet); "
                "use group_size 1 or unset engine.speculative_algorithm"
            )
        return group_size
