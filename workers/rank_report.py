"""What a replica reports per DP rank: load and prefix-cache summary (for the router's
``load`` poll, ``router.routing.rank_routing``), and the per-rank metrics and counters.

A replica without DP attention is one rank (0): its engine's scheduler. With DP attention
the leader's :class:`~dsv3serve.engine.scheduler.dp.DPScheduler` holds one scheduler per
rank. Read on the engine's step thread (``AsyncEngine.call``) for the load, at scrape time
for the metrics (as the engine-wide gauges are).
"""

from __future__ import annotations

from collections.abc import Callable

from dsv3serve.engine.engine import Engine, scheduler_state
from dsv3serve.engine.scheduler.dp import DPScheduler
from dsv3serve.engine.scheduler.scheduler import Scheduler
from dsv3serve.metrics import EngineState
from workers.protocol import MAX_PREFIX_HASHES, RankLoad


def rank_schedulers(scheduler: Scheduler | DPScheduler) -> list[Scheduler]:
    """The per-rank schedulers of ``scheduler``, in rank order (itself without DP)."""
    return list(scheduler.ranks) if isinstance(scheduler, DPScheduler) else [scheduler]


def rank_loads(
    scheduler: Scheduler | DPScheduler, max_hashes: int = MAX_PREFIX_HASHES
) -> list[RankLoad]:
    """Every rank's load and at most ``max_hashes`` of its cached prefixes' hashes."""
    return [
        RankLoad(
            dp_rank=rank,
            running=s.num_running,
            waiting=s.num_waiting,
            free_pages=s.kv.available_pages,
            num_pages=s.kv.num_pages,
            prefix_hashes=s.kv.prefix_hashes(min(max_hashes, MAX_PREFIX_HASHES), True),
            host_prefix_hashes=_host_hashes(s, min(max_hashes, MAX_PREFIX_HASHES)),
        )
        for rank, s in enumerate(rank_schedulers(scheduler))
    ]


def _host_hashes(scheduler: Scheduler, max_hashes: int) -> list[int]:
    """Hashes of the prefixes held only in the rank's host tier (none without one)."""
    if scheduler.kv.host_tier is None:
        return []
    return scheduler.kv.prefix_hashes(max_hashes, False)


def rank_counts(scheduler: Scheduler | DPScheduler) -> tuple[list[int], int]:
    """Requests each DP rank took, and how many of those a router's rank could not take
    (empty and 0 without DP attention: the router's rank is the only one)."""
    if not isinstance(scheduler, DPScheduler):
        return [], 0
    return list(scheduler.placed), sum(scheduler.fallbacks)


def rank_state_readers(engine: Engine) -> list[Callable[[], EngineState]]:
    """One scrape-time reader per DP rank (the engine's own without DP attention)."""
    scheduler = engine.scheduler
    if not isinstance(scheduler, DPScheduler):
        return [engine.engine_state]

    def reader(rank: int) -> Callable[[], EngineState]:
        def read() -> EngineState:
            return scheduler_state(
                scheduler.ranks[rank],
                placed=scheduler.placed[rank],
                fallbacks=scheduler.fallbacks[rank],
            )

        return read

    return [reader(rank) for rank in range(scheduler.dp_size)]
