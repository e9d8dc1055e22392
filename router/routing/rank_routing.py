"""Routing to (replica, DP rank): each replica's per-rank reports, polled from its
``load`` (``WorkerLoad.ranks``), scored by ``router.routing.rank_policy`` for every request.

A :class:`RankBoard` holds one replica set's last reports, refreshed every
``interval_s`` by a background poll, and this router's own in-flight requests per
(replica, rank): between two polls a rank's load is the larger of what it reported, less
the requests of this router that ended there since the poll was sent, and what this
router has in flight there, so a burst of requests spreads before the next report and a
request that just ended does not weigh on its rank until then.
Replicas with no report yet, or marked down, come after every reported candidate (by
the router's own load), with no rank named: their DP scheduler picks.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import replace
from typing import Any

from router.config import RouterSettings
from router.routing.policy import ReplicaSet, prefill_order
from router.routing.rank_policy import RankReport, RoutingWeights, rank_candidates
from workers.protocol import WorkerLoad
from workers.protocol import decode as parse

LOAD_TIMEOUT_S = 2.0
Target = tuple[int, int | None]  # (replica index, DP rank or None: the replica picks)


def reports_of(replica: int, load: WorkerLoad) -> list[RankReport]:
    """The rank reports in one replica's ``load`` answer (one per DP rank)."""
    return [
        RankReport(
            replica=replica,
            dp_rank=r.dp_rank,
            free_pages=min(r.free_pages, r.num_pages),
            num_pages=r.num_pages,
            running=r.running,
            waiting=r.waiting,
            prefix_hashes=frozenset(r.prefix_hashes),
            host_prefix_hashes=frozenset(r.host_prefix_hashes),
        )
        for r in load.ranks
    ]


async def _fetch_load(handle: Any) -> WorkerLoad:
    raw = await asyncio.wait_for(_await(handle.load.remote()), LOAD_TIMEOUT_S)
    return parse(WorkerLoad, raw)


async def _await(response: Any) -> Any:
    return await response


class RankBoard:
    """The per-DP-rank view of one replica set (see the module docstring)."""

    def __init__(
        self,
        replicas: ReplicaSet,
        page_size: int,
        weights: RoutingWeights,
        interval_s: float,
        fetch: Callable[[Any], Awaitable[WorkerLoad]] = _fetch_load,
    ) -> None:
        self.replicas = replicas
        self.page_size = page_size
        self.weights = weights
        self.interval_s = interval_s
        self._fetch = fetch
        self.reports: dict[int, list[RankReport]] = {}
        self.inflight: Counter[tuple[int, int]] = Counter()
        self.ended: Counter[tuple[int, int]] = Counter()  # since the last poll was sent
        self._task: asyncio.Task[None] | None = None

    # ---- reports ----------------------------------------------------------------------
    async def refresh(self) -> None:
        """Poll every replica's ``load`` once; a replica whose call fails drops out (its
        candidates come back with its next answer). One that is only slow to answer (a
        long step holds its engine) keeps its last reports: dropping them would route
        blind, by the replica's own prefix cache alone."""
        members = self.replicas.members()  # a replica out of the set is not polled
        for index in set(self.reports) - set(members):
            self.reports.pop(index)
        handles = [self.replicas.handles[i] for i in members]
        ended = Counter(self.ended)  # what the answers will count no more
        answers = await asyncio.gather(*(self._fetch(h) for h in handles), return_exceptions=True)
        for index, answer in zip(members, answers, strict=True):
            if isinstance(answer, WorkerLoad) and answer.ranks:
                self.reports[index] = reports_of(index, answer)
                self.ended -= Counter({k: n for k, n in ended.items() if k[0] == index})
            elif not isinstance(answer, TimeoutError):
                self.reports.pop(index, None)

    def start(self) -> None:
        """Start the background poll (once; needs a running event loop)."""
        if self._task is not None and not self._task.done():
            return
        loop = asyncio.get_running_loop()
        # a fresh context: the poll outlives the request that started it
        self._task = contextvars.Context().run(loop.create_task, self._poll())

    async def _poll(self) -> None:
        while True:
            with contextlib.suppress(Exception):
                await self.refresh()
            await asyncio.sleep(self.interval_s)

    # ---- choice -----------------------------------------------------------------------
    def _effective(self, report: RankReport) -> RankReport:
        key = (report.replica, report.dp_rank)
        reported = report.running - self.ended[key]
        return replace(report, running=max(reported, self.inflight[key] - report.waiting, 0))

    def order(self, prompt_ids: Sequence[int]) -> list[Target]:
        """Targets for ``prompt_ids``, best first: scored reported ranks of up replicas,
        then the other replicas by load (no rank named)."""
        self.start()
        down = self.replicas.down
        reports = [
            self._effective(r)
            for index, ranks in sorted(self.reports.items())
            if index not in down and index not in self.replicas.out and index < len(self.replicas)
            for r in ranks
        ]
        ranked = rank_candidates(reports, prompt_ids, self.page_size, self.weights)
        targets: list[Target] = [(c.replica, c.dp_rank) for c in ranked]
        scored = {c.replica for c in ranked}
        targets += [(i, None) for i in self.replicas.by_load() if i not in scored]
        return targets

    def acquire(self, replica: int, dp_rank: int | None) -> None:
        """This router sent a request to (``replica``, ``dp_rank``)."""
        if dp_rank is not None:
            self.inflight[(replica, dp_rank)] += 1

    def release(self, replica: int, dp_rank: int | None, ended: bool = True) -> None:
        """That request ended there (``ended`` False: it was only asked, never ran)."""
        if dp_rank is not None:
            self.inflight[(replica, dp_rank)] -= 1
            if self.inflight[(replica, dp_rank)] <= 0:
                del self.inflight[(replica, dp_rank)]
            if ended:
                self.ended[(replica, dp_rank)] += 1


def replica_targets(order: Sequence[int]) -> list[Target]:
    """Replica indices as targets that name no DP rank (the older policies)."""
    return [(i, None) for i in order]


def routing_weights(settings: RouterSettings) -> RoutingWeights:
    """The ``rank_aware`` policy's prices from the router's settings."""
    return RoutingWeights(
        settings.rank_tokens_per_request,
        settings.rank_tokens_per_pool,
        settings.rank_host_hit_value,
    )


def rank_board(replicas: ReplicaSet, settings: RouterSettings, page_size: int) -> RankBoard | None:
    """The board of ``replicas`` under ``settings`` (None unless policy ``rank_aware``)."""
    if settings.policy != "rank_aware":
        return None
    weights = routing_weights(settings)
    return RankBoard(replicas, page_size, weights, settings.rank_report_interval_s)


class PDTargets:
    """Where a PD request goes, under the router's ``policy``: (replica, DP rank) targets
    for prefill and for decode, and the in-flight accounting of both boards."""

    def __init__(
        self, prefill: ReplicaSet, decode: ReplicaSet, settings: RouterSettings, page_size: int
    ) -> None:
        weights = routing_weights(settings)
        interval = settings.rank_report_interval_s
        self.prefill = RankBoard(prefill, page_size, weights, interval)
        self.decode = RankBoard(decode, page_size, weights, interval)
        self.settings = settings
        self.page_size = page_size

    def for_prefill(self, prompt_ids: list[int]) -> list[Target]:
        """Prefill targets, best first."""
        s = self.settings
        if s.policy == "rank_aware":
            return self.prefill.order(prompt_ids)
        block = s.prefix_affinity_pages * self.page_size
        replicas = self.prefill.replicas
        order = prefill_order(replicas, prompt_ids, s.policy, block, s.affinity_imbalance_tokens)
        return replica_targets(order)

    def for_decode(self, prompt_ids: list[int]) -> list[Target]:
        """Decode targets, best first (the older policies: this router's own load)."""
        if self.settings.policy == "rank_aware":
            return self.decode.order(prompt_ids)
        return replica_targets(self.decode.replicas.by_load())
