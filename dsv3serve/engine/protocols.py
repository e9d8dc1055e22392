"""The engine's seams as types: what a step is scheduled by and what runs it.

:class:`StepScheduler` is what :class:`~dsv3serve.engine.core.EngineCore` and the loops
ask of a scheduler; :class:`~dsv3serve.engine.scheduler.scheduler.Scheduler` (one pool) and
:class:`~dsv3serve.engine.scheduler.dp.DPScheduler` (DP attention: one per DP rank) both
satisfy it. :class:`StepRunner` is what runs a step's forward: a
:class:`~dsv3serve.engine.model_runner.ModelRunner`, or a group leader that drives its
group's ranks (:class:`~dsv3serve.engine.group.tp.GroupLeader`,
:class:`~dsv3serve.engine.group.dp.DPGroupLeader`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Protocol

import torch

from dsv3serve.engine.scheduler.sequence import (
    ScheduledBatch,
    ScheduledItem,
    SchedulerConfig,
    Sequence,
)
from dsv3serve.kvcache.pool import MLAKVPool

if TYPE_CHECKING:
    from dsv3serve.engine.eplb_runtime import EplbRuntime
    from dsv3serve.engine.model_runner import StepResult
    from dsv3serve.engine.scheduler.pd import KVReservation
    from dsv3serve.kvcache.radix_cache import PrefixMatch

__all__ = ["KVCounters", "StepRunner", "StepScheduler"]


class KVCounters(Protocol):
    """The KV page counters metrics and load reports read (one pool, or all DP ranks')."""

    @property
    def num_pages(self) -> int: ...
    @property
    def free_pages(self) -> int: ...
    @property
    def evictable_pages(self) -> int: ...
    @property
    def available_pages(self) -> int: ...
    @property
    def usage(self) -> float: ...


class StepScheduler(Protocol):
    """What the engine asks of its scheduler, step by step and for PD transfers."""

    config: SchedulerConfig

    @property
    def kv(self) -> KVCounters: ...
    @property
    def has_unfinished(self) -> bool: ...
    def add(self, seq: Sequence) -> None: ...
    def schedule(self) -> ScheduledBatch | None: ...
    def on_step_done(
        self, batch: ScheduledBatch, sampled: Mapping[str, int | list[int]]
    ) -> None: ...
    def on_step_launched(self, batch: ScheduledBatch, placeholders: Mapping[str, int]) -> None: ...
    def resolve_token(self, item: ScheduledItem, placeholder: int, token: int) -> bool: ...
    def rollback_launch(self, item: ScheduledItem) -> None: ...
    def finish(self, seq: Sequence, reason: str) -> bool: ...
    def abort(self, request_id: str) -> bool: ...
    def pop_finished(self) -> list[Sequence]: ...
    def reserve(self, num_tokens: int) -> list[int] | None: ...
    def reserve_prompt(self, prompt: list[int], salt: str = "") -> KVReservation | None: ...
    def release_reservation(self, pages: list[int]) -> None: ...
    def release_prompt(self, reservation: KVReservation) -> None: ...
    def add_prefilled(self, seq: Sequence, pages: list[int], prefix: PrefixMatch = ...) -> None: ...
    def release_exported(self, seq: Sequence) -> None: ...


class StepRunner(Protocol):
    """What runs a step's forward, and what the serving layer reads of the rank it runs on."""

    @property
    def device(self) -> torch.device: ...
    @property
    def dtype(self) -> torch.dtype: ...
    @property
    def pool(self) -> MLAKVPool: ...
    @property
    def eplb(self) -> EplbRuntime | None: ...
    def run(self, items: list[ScheduledItem]) -> StepResult:
        """Logits of the sampled rows of one step over ``items``."""
        ...

    def share_sampled(self, start: int, token_ids: torch.Tensor) -> None:
        """Overlap scheduling: the step's sampled ids, for every rank's ring."""
        ...
