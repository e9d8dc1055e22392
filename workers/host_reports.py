"""What a worker replica reports about itself: info, load, progress, stats, health, and
its group's KV fingerprints (the read-only half of :class:`~workers.host.EngineHost`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from dsv3serve.engine.async_engine import AsyncEngine
from dsv3serve.engine.engine import Engine
from dsv3serve.engine.group.tp import pool_digest
from workers.config import WorkerConfig
from workers.kv_intake import KVIntake
from workers.protocol import WorkerInfo, WorkerLoad, WorkerProgress, WorkerStats
from workers.rank_report import rank_counts, rank_loads
from workers.staging import AttemptStaging
from workers.worker_metrics import WorkerMetrics

if TYPE_CHECKING:
    from kv_transfer.base import KVConnector
    from workers.group import Group


class HostReports:
    """The reports of an engine host; :class:`~workers.host.EngineHost` sets the state."""

    cfg: WorkerConfig
    engine: Engine
    aengine: AsyncEngine
    connector: KVConnector | None
    intake: KVIntake
    staging: AttemptStaging
    metrics: WorkerMetrics
    group: Group | None
    cancelled_prefills: int

    def info(self) -> WorkerInfo:
        cfg = self.cfg.engine
        context = cfg.max_model_len or self.engine.model_cfg.max_position_embeddings
        # per DP rank: a DP scheduler's config describes one rank's pool
        capacity = self.engine.scheduler.config.num_pages * cfg.page_size
        return WorkerInfo(
            role=self.cfg.role,
            max_model_len=min(context, capacity),
            page_size=cfg.page_size,
            vocab_size=self.engine.model_cfg.vocab_size,
            kv_capacity_tokens=capacity,
        )

    def load(self) -> WorkerLoad:
        def read(e: Engine) -> WorkerLoad:
            s = e.scheduler
            return WorkerLoad(
                role=self.cfg.role,
                running=s.num_running,
                waiting=s.num_waiting,
                free_pages=s.kv.available_pages,
                num_pages=s.kv.num_pages,
                ranks=rank_loads(s),
            )

        return self.aengine.call(read)

    def progress(self) -> WorkerProgress:
        """Steps finished and whether one runs now; never waits for the engine lock (a
        router tells a busy replica from an unresponsive one by it)."""
        self.check_health()
        return WorkerProgress(steps=self.aengine.steps_done, stepping=self.aengine.stepping)

    def stats(self) -> WorkerStats:
        def read(e: Engine) -> WorkerStats:
            kv = e.scheduler.kv
            placed, fallbacks = rank_counts(e.scheduler)
            return WorkerStats(
                role=self.cfg.role,
                free_pages=kv.free_pages,
                num_pages=kv.num_pages,
                evictable_pages=kv.evictable_pages,
                live_requests=e.num_live_sequences,
                staged_kv=0 if self.connector is None else self.connector.staged(),
                reservations=len(self.intake.reserved),
                group_size=self.cfg.group_size,
                pulled_pages=self.metrics.pulled_pages,
                reused_pages=self.metrics.reused_pages,
                overlapped_pages=self.metrics.overlapped_pages,
                pending_kv=len(self.staging.ranges) + len(self.intake.pulls),
                rank_requests=placed,
                rank_fallbacks=fallbacks,
                cancelled_prefills=self.cancelled_prefills,
            )

        return self.aengine.call(read)

    def gather_rank_metrics(self) -> None:
        """Before a scrape (on the event loop): the follower ranks' dispatch meters as last
        answered, for this replica's exposition, and a new ask started (a group's rank 0
        meters itself in this process)."""
        if self.group is not None:
            self.metrics.group_dispatch = self.group.dispatch_stats()

    def check_health(self) -> None:
        """Raise if this replica cannot serve: its engine died (EngineDeadError) or a rank of
        its group ended. Never blocks."""
        self.aengine.check_alive()
        if self.group is not None:
            self.group.check()

    def kv_digests(self) -> list[list[float]]:
        """Every rank's KV pool fingerprint, one float per layer, in rank order (one entry
        without a group). TP ranks hold the same pool; DP-attention ranks their own."""
        group = self.group
        if group is None:
            return [self.aengine.call(lambda e: pool_digest(e.runner.pool)).tolist()]
        digests = self.aengine.call(lambda _: group.driver().digests())
        return [d.tolist() for d in digests]

    def group_in_sync(self) -> bool:
        """Whether every TP rank's KV pool holds the same bytes (True without a group)."""
        if self.cfg.engine.enable_dp_attention:
            raise ValueError("group_in_sync: DP-attention ranks hold different pools")
        digests = self.kv_digests()
        return all(d == digests[0] for d in digests)
