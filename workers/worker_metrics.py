"""A worker's metrics: the shared definitions bound to this replica, and what it observes."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, Callable, Sequence

from prometheus_client import generate_latest

from dsv3serve.metrics import (
    DispatchStatsCollector,
    EngineState,
    EngineStateCollector,
    EplbHotRatioCollector,
    Identity,
    Metrics,
)
from dsv3serve.parallel.dispatch_meter import process_snapshots
from kv_transfer.handle import TransferStats
from workers.protocol import TokenChunk


class WorkerMetrics:
    """Metrics of one replica (``role``, ``replica``, ``model`` labels).

    Expert-parallel dispatch metrics come from every rank of the replica's group: this
    process's meters (rank 0) and ``group_dispatch``, the followers' snapshots the host
    gathered before the scrape (``EngineHost.gather_rank_metrics``).
    """

    def __init__(
        self,
        identity: Identity,
        rank_states: Sequence[Callable[[], EngineState]],
        eplb_hot: Callable[[], list[float]] = list,
    ) -> None:
        """``rank_states``: one engine-state reader per DP rank (``dp_rank`` label);
        ``eplb_hot``: the group's hot-expert ratio per MoE layer (empty without EPLB)."""
        self.m = Metrics(identity)
        for rank, read in enumerate(rank_states):
            self.m.registry.register(EngineStateCollector(identity, read, rank))
        self.group_dispatch: list[dict] = []
        self.m.registry.register(
            DispatchStatsCollector(identity, lambda: process_snapshots() + self.group_dispatch)
        )
        self.m.registry.register(EplbHotRatioCollector(identity, eplb_hot))
        self.pulled_pages = 0
        self.reused_pages = 0
        self.overlapped_pages = 0

    def exposition(self) -> bytes:
        """This replica's metrics in the Prometheus text format."""
        return generate_latest(self.m.registry)

    async def stream(
        self, chunks: AsyncGenerator[TokenChunk, None], count_prompt: bool, n: int = 1
    ) -> AsyncGenerator[TokenChunk, None]:
        """Pass ``chunks`` through, counting tokens, finish reasons and decode time.

        Of the ``n`` sequences, those unfinished when the consumer closes the stream (the
        router aborted the request) count as finished with ``abort``.
        """
        first_at: float | None = None
        finished: set[int] = set()
        try:
            async for chunk in chunks:
                if chunk.token_ids:
                    now = time.monotonic()
                    if first_at is None:
                        first_at = now
                        if count_prompt:
                            self.m.prompt_tokens.inc(chunk.prompt_tokens)
                    self.m.generation_tokens.inc(len(chunk.token_ids))
                if chunk.finished:
                    finished.add(chunk.index)
                    self.m.finished(chunk.finish_reason or "unknown")
                    if first_at is not None:
                        self.m.decode_time.observe(time.monotonic() - first_at)
                yield chunk
        except (GeneratorExit, asyncio.CancelledError):
            for _ in range(n - len(finished)):
                self.m.finished("abort")
            raise

    def prefilled(self, seconds: float, prompt_tokens: int) -> None:
        self.m.prefill_time.observe(seconds)
        self.m.prompt_tokens.inc(prompt_tokens)

    def transferred(
        self,
        stats: TransferStats,
        pulled_pages: int,
        reused_pages: int,
        overlapped: bool = False,
    ) -> None:
        """Count one pull of ``pulled_pages`` pages, and the ``reused_pages`` prompt pages
        it did not move because the decode side's prefix cache held them; ``overlapped``:
        a range pulled while its prefill still ran (counted in both page counters)."""
        self.pulled_pages += pulled_pages
        self.reused_pages += reused_pages
        self.m.transfer_pages.inc(pulled_pages)
        if overlapped:
            self.overlapped_pages += pulled_pages
            self.m.transfer_overlapped_pages.inc(pulled_pages)
        self.m.transfer_reused_pages.inc(reused_pages)
        self.m.transfer_latency.observe(stats.seconds)
        self.m.transfer_size.observe(stats.nbytes)
        self.m.transfer_speed.observe(stats.gbps * 1e9)
        self.m.transfer_bytes.inc(stats.nbytes)
