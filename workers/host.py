"""One replica's engine and its PD duties, without Ray: the deployments wrap this.

A host runs the engine loop, stages prefilled KV for a pull (prefill role), holds page
reservations for incoming KV (decode role), and frees both when their lease runs out.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, Callable
from contextlib import aclosing
from typing import TYPE_CHECKING

import torch

from dsv3serve.engine.async_engine import AsyncEngine, EngineDeadError, PrefillReleasedError
from dsv3serve.engine.engine import Engine, InvalidRequestError, KVExport, KVReservation
from dsv3serve.engine.group.rank import attach_leader
from dsv3serve.engine.request import Request, TokenOutput
from dsv3serve.engine.scheduler.sequence import ContextLengthError
from dsv3serve.metrics import Identity
from workers.autoscale_stats import AutoscaleStats
from workers.config import WorkerConfig
from workers.convert import chunk_from_output
from workers.draft_wire import draft_to_wire
from workers.fault_injection import with_receive_delay
from workers.host_reports import HostReports
from workers.kv_intake import HandoffError, KVIntake
from workers.protocol import (
    DecodeRequest,
    GenerateRequest,
    PrefillEvent,
    PrefillRequest,
    PrefillResult,
    PullRequest,
    PullResult,
    ReserveRequest,
    ReserveResult,
    TokenChunk,
    error_chunk,
)
from workers.ranges import ranges_while, require_connector
from workers.rank_report import rank_state_readers
from workers.reservations import reservation_rank, reserve_for
from workers.staging import AttemptStaging
from workers.worker_metrics import WorkerMetrics

if TYPE_CHECKING:
    from kv_transfer.base import KVConnector
    from workers.group import Group

REAP_INTERVAL_S = 0.2
logger = logging.getLogger(__name__)
# Starts ranks 1..N-1, joins them (before the engine is built): ``.stop()``, ``.check()``
# (raises once a rank died), a ``.leader`` slot the host fills.
GroupStarter = Callable[[WorkerConfig], "Group"]
_REFUSED = (InvalidRequestError, ContextLengthError)


class WrongRoleError(RuntimeError):
    """A call meant for another role (e.g. ``prefill`` on a decode replica)."""


async def _chunks(outputs: AsyncGenerator[TokenOutput, None]) -> AsyncGenerator[TokenChunk, None]:
    async for out in outputs:
        yield chunk_from_output(out)


async def _unless_dead(
    request_id: str, chunks: AsyncGenerator[TokenChunk, None]
) -> AsyncGenerator[TokenChunk, None]:
    """``chunks``, ended by a 503 error chunk if the engine dies (a rank of its group died or
    a collective timed out): the router answers the client; the health check restarts us."""
    try:
        async with aclosing(chunks) as it:
            async for chunk in it:
                yield chunk
    except EngineDeadError as exc:
        yield error_chunk(request_id, f"{exc}; this replica is restarting", 503)


def _released_result(req: GenerateRequest, attempt: str) -> PrefillResult:
    message = f"prefill attempt {attempt!r} was released by its router; nothing staged"
    return PrefillResult(first=error_chunk(req.request_id, message, 503), kv=None)


def _engine_request(
    req: GenerateRequest, engine_id: str | None = None, dp_rank: int | None = None
) -> Request:
    rid = req.request_id if engine_id is None else engine_id
    return Request(rid, req.params, prompt_ids=list(req.prompt_ids), dp_rank=dp_rank)


class EngineHost(HostReports):
    """The engine of one replica plus its staged KV and reservations."""

    def __init__(
        self,
        cfg: WorkerConfig,
        group_starter: GroupStarter | None = None,
        replica: str = "",
        model: str = "",
    ) -> None:
        if cfg.torch_threads:
            torch.set_num_threads(cfg.torch_threads)
        self.cfg = cfg
        self.group: Group | None = None
        if cfg.group_size > 1:
            if group_starter is None:
                raise ValueError(f"tp_size {cfg.group_size} needs a group starter (Ray)")
            self.group = group_starter(cfg)  # every rank joins before any builds its shard
        self.engine = Engine(cfg.engine)
        if self.group is not None:
            self.group.leader = attach_leader(self.engine)
        identity = Identity(cfg.role, replica or cfg.role, model or cfg.engine.model)
        eplb = self.engine.runner.eplb
        hot = list if eplb is None else (lambda: eplb.hot_ratios)
        self.metrics = WorkerMetrics(identity, rank_state_readers(self.engine), hot)
        self.engine.metrics = self.metrics.m
        self.aengine = AsyncEngine(self.engine)
        self.connector = self._make_connector()
        self.staging = AttemptStaging(
            self.aengine, self.connector, cfg.kv_lease_s, cfg.engine.page_size
        )
        self.intake = KVIntake(cfg, self.aengine, self.connector, self.metrics, self.group)
        self._reaper: asyncio.Task[None] | None = None
        self.overlap_off = self._overlap_off()
        self.autoscale = AutoscaleStats()
        self.cancelled_prefills = 0  # prefill tries cancelled while they ran (WorkerStats)
        if cfg.role == "prefill" and self.overlap_off is None:
            self.engine.on_pages_dropped(self.staging.ranges.drop)
        elif cfg.role == "prefill":
            logger.info("KV transfer not overlapped with prefill: %s", self.overlap_off)

    def close(self) -> None:
        """Free staged KV (shared-memory segments included).

        The group's follower ranks are child actors: they end with this replica.
        """
        if self.connector is not None:
            self.connector.close()

    def _make_connector(self) -> KVConnector | None:
        if self.cfg.role == "colocated":
            return None
        from kv_transfer.factory import create_kv_connector

        pool, cfg = self.engine.runner.pool, self.cfg
        connector = create_kv_connector(cfg.kv_connector, pool, **cfg.kv_connector_options)
        return with_receive_delay(connector, cfg.test_receive_delay_s)

    def _overlap_off(self) -> str | None:
        """Why this replica stages a prefill's KV only once it is done (None: it stages the
        pages of finished chunks while later chunks run, ``prefill_stream``)."""
        if self.cfg.role != "prefill":
            return f"a {self.cfg.role} replica prefills nothing for a pull"
        connector = require_connector(self.connector)
        if not connector.incremental:
            return f"connector {connector.name} stages each request's pages once"
        if self.engine.spec is not None:
            return (
                "speculative decoding: the pages also hold the draft layer's KV, not "
                "checked final when a chunk ends (not built)"
            )
        return None

    def _require(self, role: str) -> None:
        if self.cfg.role != role:
            raise WrongRoleError(f"this replica's role is {self.cfg.role}, not {role}")

    def _start_reaper(self) -> None:
        if self._reaper is None or self._reaper.done():
            self._reaper = asyncio.get_running_loop().create_task(self._reap())

    async def _reap(self) -> None:
        while True:
            await asyncio.sleep(REAP_INTERVAL_S)
            self.staging.expire()
            self.intake.reserved.expire()

    # ---- colocated -------------------------------------------------------------------------
    def generate(self, req: GenerateRequest) -> AsyncGenerator[TokenChunk, None]:
        """Colocated serving: the whole request here; closing the stream aborts it."""
        self._require("colocated")
        return _unless_dead(req.request_id, self._generate(req))

    async def _generate(self, req: GenerateRequest) -> AsyncGenerator[TokenChunk, None]:
        try:
            stream = self.aengine.generate(_engine_request(req, dp_rank=req.dp_rank))
            metered = self.metrics.stream(_chunks(stream), True, req.params.n)
            async with aclosing(stream), aclosing(metered) as chunks:
                async for chunk in chunks:
                    yield chunk
        except _REFUSED as exc:
            yield error_chunk(req.request_id, str(exc), 400)

    # ---- prefill ---------------------------------------------------------------------------
    async def prefill(self, msg: PrefillRequest) -> PrefillResult:
        """Prefill to the first token and stage the prompt's KV pages under a lease.

        The engine runs the request, and the KV is staged, under ``msg.attempt_id``. An
        attempt released before or while it runs stages nothing and answers a 503 chunk
        (its router has given up on it).
        """
        self._require("prefill")
        self.check_health()  # raises: the router retries another prefill replica
        self._start_reaper()
        req, attempt = msg.request, msg.attempt_id
        if self.cfg.test_prefill_delay_s:
            await asyncio.sleep(self.cfg.test_prefill_delay_s)
        if self.staging.is_released(attempt):
            return _released_result(req, attempt)
        try:
            self.staging.check_skip(len(req.prompt_ids), msg.skip_pages)
        except ValueError as exc:  # the router's bug: fail before the prefill runs
            return PrefillResult(first=error_chunk(req.request_id, str(exc), 500), kv=None)
        start = time.monotonic()
        prompt, took = len(req.prompt_ids), None
        self.autoscale.prefill_started(prompt)
        try:
            engine_req = _engine_request(req, attempt, msg.dp_rank)
            first, export = await self.aengine.prefill(engine_req)
            took = time.monotonic() - start
        except _REFUSED as exc:
            return PrefillResult(first=error_chunk(req.request_id, str(exc), 400), kv=None)
        except PrefillReleasedError:
            return _released_result(req, attempt)
        except asyncio.CancelledError:  # its router gave the try up, or its client left
            self.cancelled_prefills += 1
            raise
        finally:
            self.autoscale.prefill_ended(prompt, took)
        if self.staging.is_released(attempt):  # its release is queued or done: stage nothing
            return _released_result(req, attempt)
        self.metrics.prefilled(time.monotonic() - start, len(req.prompt_ids))
        return self._stage(msg, first, export)

    async def prefill_stream(self, msg: PrefillRequest) -> AsyncGenerator[PrefillEvent, None]:
        """:meth:`prefill` with the KV transfer overlapped: while later chunks run, the
        prompt pages of finished chunks are staged as ranges, each yielded as it is; the
        result comes last, its handle holding only the pages after them. Without overlap
        here (``overlap_off`` says why) the result is all it yields.

        Ranges go with the attempt (``release_kv``, its lease, or its failure here).
        """
        if self.overlap_off is not None:
            yield PrefillEvent(result=await self.prefill(msg))
            return
        attempt, ranges = msg.attempt_id, self.staging.ranges
        ranges.open(attempt, msg.skip_pages)
        task = asyncio.ensure_future(self.prefill(msg))
        staged = False
        try:
            async with aclosing(ranges_while(task, self.aengine, ranges, attempt)) as handles:
                async for handle in handles:
                    yield PrefillEvent(kv_range=handle)
            result = await task
            staged = result.kv is not None
            yield PrefillEvent(result=result)
        finally:
            if not task.done():
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task
            if not staged:  # nothing staged to release later: the ranges go now
                ranges.close(attempt)

    def _stage(
        self, msg: PrefillRequest, first: TokenOutput, export: KVExport | None
    ) -> PrefillResult:
        """The first token, and ``export``'s pages past ``msg.skip_pages`` staged for a pull
        (with the draft state)."""
        req, attempt = msg.request, msg.attempt_id
        first_chunk = chunk_from_output(first).model_copy(update={"request_id": req.request_id})
        if export is None:
            return PrefillResult(first=first_chunk, kv=None)
        try:
            draft = None if export.draft is None else draft_to_wire(export.draft)
        except BaseException:
            self.staging.unstage(attempt)
            raise
        handle = self.staging.stage(attempt, export, len(req.prompt_ids), msg.skip_pages)
        return PrefillResult(first=first_chunk, kv=handle, draft=draft)

    async def release_kv(self, attempt_id: str) -> None:
        """Free everything prefill attempt ``attempt_id`` holds here: its staged KV, or the
        attempt itself if it still runs; returns once the engine's step thread has freed
        it. Idempotent, and fenced: a later ``prefill`` of the same attempt stages nothing.
        An unknown attempt (another replica's, or one freed already) is a no-op."""
        self._start_reaper()
        await self.staging.release(attempt_id)

    # ---- decode ----------------------------------------------------------------------------
    async def reserve(self, msg: ReserveRequest) -> ReserveResult:
        """Admission on the decode side: hold pages for the incoming KV under a lease.

        With ``msg.prompt_ids`` the prompt's prefix cached here is locked instead of
        reserved, and the result says how many leading pages need no pull.
        """
        self._require("decode")
        self.check_health()  # a group with a dead rank takes no new work
        if self.cfg.test_reserve_delay_s:
            await asyncio.sleep(self.cfg.test_reserve_delay_s)
        reuse = self.cfg.decode_prefix_reuse

        def reserve_here(e: Engine) -> tuple[KVReservation, int] | None:
            res = reserve_for(e, msg, reuse)
            return None if res is None else (res, reservation_rank(e, res))

        reserved = await self.aengine.read(reserve_here)
        if reserved is None:
            return ReserveResult(ok=False, progress=self.room_progress)
        res, rank = reserved
        self.intake.hold(msg.request_id, res, msg.lease_s)
        self._start_reaper()  # a reservation no decode ever takes over expires with its lease
        return ReserveResult(
            ok=True, num_pages=len(res.pages), cached_pages=res.num_cached_pages, dp_rank=rank
        )

    @property
    def room_progress(self) -> int:
        """Grows while this replica works towards freeing KV room: its engine's steps (what
        a refusal reports; a stream cut by its client frees its room without a step, and
        the next ask finds that room)."""
        return self.aengine.steps_done

    def cancel_reservation(self, request_id: str) -> None:
        """Give back a reservation that will not be used. Idempotent."""
        self.intake.cancel(request_id)

    async def pull_kv(self, msg: PullRequest) -> PullResult:
        """Overlapped transfer: pull a range of prompt pages that prefill attempt
        ``msg.attempt_id`` staged while it still runs into the reservation of
        ``msg.request_id`` (see ``KVIntake.pull_range``)."""
        self._require("decode")
        return await self.intake.pull_range(msg)

    def decode(self, msg: DecodeRequest) -> AsyncGenerator[TokenChunk, None]:
        """Pull the KV into the reservation, then stream every output token."""
        self._require("decode")
        return _unless_dead(msg.request.request_id, self._decode(msg))

    async def _decode(self, msg: DecodeRequest) -> AsyncGenerator[TokenChunk, None]:
        self._start_reaper()
        rid = msg.request.request_id
        try:
            res, draft = await self.intake.take_over(msg)
        except HandoffError as exc:
            yield error_chunk(rid, str(exc), 503)
            return
        top = dict(msg.first_top_logprobs)
        stream = self.aengine.generate_imported(
            _engine_request(msg.request),
            msg.first_token,
            res.pages,
            msg.first_logprob,
            top,
            draft=draft,
            prefix=res.prefix,
            cached_tokens=msg.cached_tokens,
        )
        try:
            metered = self.metrics.stream(_chunks(stream), False)
            last: float | None = None  # the first chunk's wait is the handoff, not ITL
            async with aclosing(stream), aclosing(metered) as chunks:
                async for chunk in chunks:
                    now = time.monotonic()
                    if last is not None:
                        self.autoscale.token_gap(now - last)
                    last = now
                    yield chunk
        except _REFUSED as exc:
            self.intake.unreserve(rid, res)
            yield error_chunk(rid, str(exc), 400)
