"""The decode side's incoming KV: reservations under leases, the pulls that fill them (ranges
of an overlapped transfer while the prefill runs, then the handoff's pages), and their
release once no pull writes into them any more."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from dsv3serve.engine.async_engine import AsyncEngine, EngineDeadError
from dsv3serve.engine.engine import Engine, KVReservation
from dsv3serve.engine.speculative.loop import DraftState
from kv_transfer.base import KVConnector
from kv_transfer.handle import KVHandle, TransferError, TransferStats
from workers.config import WorkerConfig
from workers.draft_wire import DraftMismatchError, draft_from_wire
from workers.leases import LeaseTable
from workers.protocol import DecodeRequest, PullRequest, PullResult
from workers.range_pulls import RangePulls
from workers.ranges import require_connector
from workers.reservations import range_mismatch, staged_mismatch
from workers.worker_metrics import WorkerMetrics

if TYPE_CHECKING:
    from workers.group import Group


class HandoffError(RuntimeError):
    """The decode side could not take over a prefilled request (answered with a 503)."""


def failure_reason(exc: Exception) -> str:
    """A failed transfer's metric label."""
    return "timeout" if "timed out" in str(exc).lower() else "error"


class KVIntake:
    """Reservations of one decode replica and the pulls into them."""

    def __init__(
        self,
        cfg: WorkerConfig,
        aengine: AsyncEngine,
        connector: KVConnector | None,
        metrics: WorkerMetrics,
        group: Group | None = None,
    ) -> None:
        self.cfg, self.aengine, self.connector = cfg, aengine, connector
        self.metrics, self.group = metrics, group
        self.reserved: LeaseTable[KVReservation] = LeaseTable(self.unreserve)
        self.pulls = RangePulls()
        self._range_faults = cfg.test_fail_range_pulls  # fault injection (tests only)

    @property
    def engine(self) -> Engine:
        return self.aengine.engine

    def hold(self, request_id: str, res: KVReservation, lease_s: float) -> None:
        """Hold ``res`` for ``request_id`` until taken over or ``lease_s`` passes; a
        reservation it held before is given back."""
        self.unreserve(request_id, self.reserved.take(request_id))
        self.pulls.after_pulls(request_id, lambda: None)  # a new request's progress
        self.reserved.add(request_id, res, lease_s)

    def cancel(self, request_id: str) -> None:
        """Give back a reservation that will not be used. Idempotent."""
        self.unreserve(request_id, self.reserved.take(request_id))

    def unreserve(self, request_id: str, res: KVReservation | None) -> None:
        """Give ``res`` back once no pull writes into it any more."""
        if res is not None:
            self.pulls.after_pulls(request_id, lambda: self._free(res))

    def _free(self, res: KVReservation) -> None:
        # now, or queued while a step runs (a dead engine frees nothing: the replica restarts)
        self.aengine.call_or_post(lambda e: e.release_prompt_kv(res))

    async def pull_range(self, msg: PullRequest) -> PullResult:
        """Pull a range that prefill attempt ``msg.attempt_id`` staged while it still runs
        into the reservation of ``msg.request_id``, after the ranges pulled before. A
        failed pull keeps the reservation (the handoff pulls what is missing, or the
        router gives it back)."""
        rid = msg.request_id
        await self.pulls.settle(rid)  # one pull at a time per reservation
        res = self.reserved.get(rid)
        if res is None:
            return PullResult(ok=False, error="no KV reservation (expired or given back)")
        done = self.pulls.pulled(rid, msg.attempt_id)
        mismatch = range_mismatch(msg.kv, res, done)
        if mismatch is not None:
            return PullResult(ok=False, error=mismatch)
        try:
            self._inject_range_fault()
            stats = await self._pull(rid, msg.kv, res, done)
        except (TransferError, EngineDeadError) as exc:
            self.metrics.m.transfer_failed(failure_reason(exc))
            return PullResult(ok=False, error=f"KV range transfer failed: {exc}")
        if self.reserved.get(rid) is not res:  # given back or expired during the copy
            return PullResult(ok=False, error="the KV reservation went away during the pull")
        self.pulls.landed(rid, msg.attempt_id, done + msg.kv.num_pages)
        self.metrics.transferred(stats, msg.kv.num_pages, 0, overlapped=True)
        return PullResult(ok=True)

    def _inject_range_fault(self) -> None:
        """Tests only (``test_fail_range_pulls``): fail this range pull as a broken
        transfer would, while faults are left."""
        if self._range_faults > 0:
            self._range_faults -= 1
            raise TransferError("injected range-pull failure (test_fail_range_pulls)")

    async def take_over(self, msg: DecodeRequest) -> tuple[KVReservation, DraftState | None]:
        """The reservation, its pages filled with the prefill side's KV, and the draft state.

        The handle holds the pages after those the attempt's ranges filled already
        (overlapped transfer), or all the reservation misses. Raises HandoffError, the
        reservation freed, when the reservation expired, the staged pages are not the
        ones it misses, the draft state is missing or does not fit, or the transfer failed.
        """
        rid = msg.request.request_id
        await self.pulls.settle(rid)
        res = self.reserved.take(rid)
        if res is None:
            raise HandoffError("the KV reservation expired before the transfer")
        pulled = await self._pull_missed(rid, msg, res)
        mismatch = staged_mismatch(msg.kv, res, pulled)
        if mismatch is not None:
            self.unreserve(rid, res)
            raise HandoffError(mismatch)
        try:
            draft = self._draft_state(msg)
        except DraftMismatchError as exc:
            self.unreserve(rid, res)
            raise HandoffError(str(exc)) from None
        await self._receive(rid, msg.kv, res)
        self.pulls.after_pulls(rid, lambda: None)  # done: its progress goes
        return res, draft

    async def _pull_missed(self, rid: str, msg: DecodeRequest, res: KVReservation) -> int:
        """Pull the attempt's ranges the overlapped transfer missed (``msg.kv_ranges``), in
        order, after those that landed; returns the reservation pages its ranges now fill.
        Raises HandoffError, the reservation freed, when one is out of order or fails."""
        attempt = msg.kv.request_id
        pulled = self.pulls.pulled(rid, attempt)
        for kv in msg.kv_ranges:
            mismatch = range_mismatch(kv, res, pulled)
            if mismatch is not None:
                self.unreserve(rid, res)
                raise HandoffError(mismatch)
            stats = await self._pull_or_free(rid, kv, res, pulled, "KV range transfer")
            pulled += kv.num_pages
            self.pulls.landed(rid, attempt, pulled)
            self.metrics.transferred(stats, kv.num_pages, 0)
        return pulled

    def _draft_state(self, msg: DecodeRequest) -> DraftState | None:
        """Where this engine's first draft chain starts; None without speculation here.

        The draft layer's KV of the prompt comes only from a speculative prefill: a
        missing draft state means the prefill side ran without speculation, and this
        engine cannot rebuild that KV, so the request is refused rather than drafted
        from rows nobody wrote.
        """
        if self.engine.spec is None:
            return None
        if msg.draft is None:
            raise DraftMismatchError(
                "this decode replica runs speculative decoding (engine.speculative_algorithm "
                f"{self.cfg.engine.speculative_algorithm}) but the prefill side sent no draft "
                "state: set the same speculative_algorithm on prefill and decode"
            )
        runner, size = self.engine.runner, self.engine.model_cfg.hidden_size
        num_tokens = len(msg.request.prompt_ids) + 1
        return draft_from_wire(msg.draft, num_tokens, size, runner.dtype, runner.device)

    async def _receive(self, rid: str, handle: KVHandle, res: KVReservation) -> None:
        """Pull ``handle`` into its place in ``res.pages`` and place it on the group; on
        failure free the reservation and raise HandoffError."""
        offset = handle.first_page - res.num_cached_pages
        stats = await self._pull_or_free(rid, handle, res, offset, "KV transfer")
        self.metrics.transferred(stats, handle.num_pages, res.num_cached_pages)
        group = self.group
        if group is None:
            return
        try:  # TP: every rank's pool; DP: the owning rank's only
            await self.aengine.read(lambda _: group.driver().replicate_pages(res.pages))
        except Exception as exc:
            self.unreserve(rid, res)
            raise HandoffError(f"KV placement on the group failed: {exc}") from None

    async def _pull_or_free(
        self, rid: str, handle: KVHandle, res: KVReservation, offset: int, what: str
    ) -> TransferStats:
        """:meth:`_pull`, the reservation taken over: on any failure it is freed and
        HandoffError raised. A cancelled caller does not interrupt the copy: the pages are
        freed only after the transfer thread has stopped writing into them."""
        try:
            return await self._pull(rid, handle, res, offset)
        except asyncio.CancelledError:
            self.unreserve(rid, res)  # once the copy has ended
            raise
        except Exception as exc:  # TransferError, a dead engine, or a connector's bug
            self.unreserve(rid, res)
            if isinstance(exc, TransferError):
                self.metrics.m.transfer_failed(failure_reason(exc))
            raise HandoffError(f"{what} failed: {exc}") from None

    async def _pull(
        self, rid: str, handle: KVHandle, res: KVReservation, offset: int
    ) -> TransferStats:
        """Pull ``handle`` into ``res.pages[offset:]`` (where the connector writes them);
        the copy is request ``rid``'s pull in flight until it ends, cancelled caller or
        not."""
        task = asyncio.ensure_future(self._copy(handle, res.pages, offset))
        self.pulls.begin(rid, task)  # before any await: a release now waits for the copy
        m = self.metrics.m
        m.in_transfer.inc()
        try:
            return await asyncio.shield(task)
        finally:
            m.in_transfer.dec()

    async def _copy(self, handle: KVHandle, pages: list[int], offset: int) -> TransferStats:
        """The connector's copy of ``handle`` into ``pages[offset:]``, on a thread."""
        landing = (await self._landing_pages(pages))[offset : offset + handle.num_pages]
        return await asyncio.to_thread(require_connector(self.connector).receive, handle, landing)

    async def _landing_pages(self, pages: list[int]) -> list[int]:
        """Pages of this process's pool the connector writes a reservation's KV into."""
        if self.group is None or not self.cfg.engine.enable_dp_attention:
            return pages
        group = self.group
        return await self.aengine.read(lambda _: group.dp_driver().landing_pages(pages))
