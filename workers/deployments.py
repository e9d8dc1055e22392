"""The Ray Serve deployment that wraps an :class:`~workers.host.EngineHost`.

One class serves every role; the app builder names one deployment per replica
(``prefill-0``, ``decode-1``, ...) so the router can choose the replica. Messages in
and out are JSON bytes validated on arrival (``workers.protocol``). torch and the engine
are imported inside the replica only, so the router process never loads them.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator
from contextlib import aclosing
from functools import partial

from ray import serve

from workers.caller_watch import CallerWatch
from workers.config import WorkerConfig
from workers.protocol import (
    DecodeRequest,
    GenerateRequest,
    PrefillRequest,
    PullRequest,
    ReserveRequest,
    encode,
)
from workers.protocol import decode as parse

logger = logging.getLogger(__name__)


@serve.deployment(max_ongoing_requests=1024, health_check_period_s=2, health_check_timeout_s=30)
class EngineWorker:
    """A prefill, decode or colocated engine replica."""

    def __init__(self, config_json: str, model_name: str = "") -> None:
        from workers.group import start_group
        from workers.host import EngineHost

        cfg = resolve_host(WorkerConfig.model_validate_json(config_json))
        context = serve.get_replica_context()
        group_name = f"{context.app_name}/{context.deployment}/{context.replica_id.unique_id}"
        starter = partial(start_group, name=group_name)
        self.host = EngineHost(cfg, starter, replica=context.deployment, model=model_name)
        self.callers = CallerWatch()

    def __del__(self) -> None:
        """Serve's graceful shutdown: unlink staged KV, stop follower ranks."""
        host = getattr(self, "host", None)
        if host is not None:
            host.close()

    async def check_health(self) -> None:
        """Serve calls this every ``health_check_period_s``; raising marks the replica
        unhealthy and Serve replaces it: the engine died (a failed step) or a follower rank
        of the group ended (its actor died)."""
        self.host.check_health()

    async def metrics(self) -> bytes:
        """This replica's Prometheus exposition (merged by the router's metrics endpoint),
        with every group rank's dispatch metrics (the followers' as last answered)."""
        self.host.gather_rank_metrics()
        return self.host.metrics.exposition()

    async def info(self) -> bytes:
        return encode(self.host.info())

    async def load(self) -> bytes:
        return encode(await asyncio.to_thread(self.host.load))  # off the loop: see read()

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """Serve's custom autoscaling metrics of this replica (workers/autoscale_stats.py),
        read by the app-level policy ``router.autoscale.serve.PDAutoscaler``."""
        load = await asyncio.to_thread(self.host.load)
        return self.host.autoscale.snapshot(load)

    async def progress(self) -> bytes:
        """WorkerProgress, answered on the event loop (no engine lock)."""
        return encode(self.host.progress())

    async def stats(self) -> bytes:
        return encode(await asyncio.to_thread(self.host.stats))

    async def group_in_sync(self) -> bool:
        """Whether every rank of this replica's group holds the same KV pool bytes."""
        return self.host.group_in_sync()

    async def kv_digests(self) -> list[list[float]]:
        """Every rank's KV pool fingerprint (per layer), in rank order."""
        return self.host.kv_digests()

    async def generate(self, data: bytes) -> AsyncGenerator[bytes, None]:
        """Colocated: stream TokenChunks of the whole request."""
        async with aclosing(self.host.generate(parse(GenerateRequest, data))) as chunks:
            async for chunk in chunks:
                yield encode(chunk)

    async def prefill(self, data: bytes) -> bytes:
        """Prefill role: PrefillRequest in, PrefillResult out."""
        return encode(await self.host.prefill(parse(PrefillRequest, data)))

    async def prefill_stream(self, data: bytes) -> AsyncGenerator[bytes, None]:
        """Prefill role, overlapped transfer: PrefillRequest in; PrefillEvents out (KV
        ranges of finished chunks as they are staged, then the PrefillResult)."""
        async with aclosing(self.host.prefill_stream(parse(PrefillRequest, data))) as events:
            async for event in events:
                yield encode(event)

    async def release_kv(self, attempt_id: str) -> None:
        """Free what prefill attempt ``attempt_id`` holds here (no-op if unknown)."""
        await self.host.release_kv(attempt_id)

    async def reserve(self, data: bytes) -> bytes:
        """Decode role: ReserveRequest in, ReserveResult out."""
        return encode(await self.host.reserve(parse(ReserveRequest, data)))

    async def pull_kv(self, data: bytes) -> bytes:
        """Decode role, overlapped transfer: PullRequest in (a KV range of a prefill still
        running), PullResult out."""
        return encode(await self.host.pull_kv(parse(PullRequest, data)))

    async def cancel_reservation(self, request_id: str) -> None:
        self.host.cancel_reservation(request_id)

    async def decode(self, data: bytes) -> AsyncGenerator[bytes, None]:
        """Decode role: pull the KV, then stream TokenChunks; ends (aborting the request)
        once the router replica that asked for it is gone (``workers.caller_watch``)."""
        msg = parse(DecodeRequest, data)
        async with aclosing(self.host.decode(msg)) as chunks:
            async for chunk in chunks:
                if msg.caller is not None and self.callers.gone(msg.caller):
                    logger.warning("decode of %s aborted: its router is gone", chunk.request_id)
                    return
                yield encode(chunk)


def resolve_host(cfg: WorkerConfig) -> WorkerConfig:
    """``kv_connector_options.host: auto`` becomes this node's cluster IP."""
    if cfg.kv_connector_options.get("host") != "auto":
        return cfg
    import ray

    options = {**cfg.kv_connector_options, "host": ray.util.get_node_ip_address()}
    return cfg.model_copy(update={"kv_connector_options": options})
