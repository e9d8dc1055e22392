"""Prefill/decode orchestration: reserve on decode, prefill, hand the KV over, stream.

Per request (n=1; ``n`` > 1 fans out into n sub-requests merged by ``fan_out``):

1. reserve pages on a decode (replica, DP rank) chosen by policy (``router.routing.rank_routing``);
   while none has room the request waits as long as decode makes progress (engine
   steps): none for ``reserve_wait_s``, or no room within ``reserve_max_wait_s``, is a
   429; every replica failing waits for
   one to come back (``decode_migration_wait_s``), then 503. The decode replica locks the
   prompt's prefix its own cache holds and reserves pages for the rest only; the prefill
   side is told to stage only those (``skip_pages``);
2. prefill on a prefill (replica, DP rank) chosen by policy; a replica that dies or
   stalls (``router.pd.prefill_watch``) is marked down (tried last until it answers again)
   and the request is retried, on another replica when one is up, up to
   ``max_prefill_attempts``, else 503; with no replica up it waits at most
   ``prefill_retry_wait_s`` (from when a try finds none up) for one to come back. Each try
   has its own attempt id: the release of a failed try names it, and never touches a
   later try;
3. the decode replica pulls the KV (the handle names the staged pages) and streams every
   output token, the first included; with MTP the prefill side's draft state rides along
   (opaque bytes here: the router imports no torch); the prefill side's staging is
   released as soon as decode answers, or by its lease. With ``overlap`` (the app's
   ``kv_transfer_overlap``) the prefill streams the KV ranges of finished chunks while it
   runs and the decode replica pulls each at once (``router.pd.range_forwarder``): the handoff then
   pulls only the pages after them;
4. a decode replica that fails (dies, or answers 503) is marked down, and the stream
   migrates: steps 1-3 again for prompt + its tokens so far (``router.pd.migration``).

Every exit path (finish, error, client disconnect) gives back the reservation, the staged
KV and the router's own load accounting.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncGenerator, Awaitable
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

from dsv3serve.metrics import Identity, Metrics
from kv_transfer.handle import KVHandle
from router.config import RouterSettings
from router.pd.fan_out import fan_out
from router.pd.migration import DecodeLost, Migrator
from router.pd.prefill_watch import prefill_failure, until_stalled
from router.pd.range_forwarder import RangeForwarder, consume_prefill
from router.pd.relay import relay
from router.pd.replica_calls import (
    Background,
    answers,
    any_alive,
    await_response,
    lost_on_503,
    progress_of,
)
from router.pd.room_signal import RESERVE_RETRY_S, RoomDeadline, RoomSignal, next_backoff
from router.pd.seam import SeamTokenizer
from router.routing.policy import ReplicaSet
from router.routing.rank_routing import PDTargets, Target
from router.routing.replica_health import ReplicaHealth
from workers.backend import BackendError, BackendOverloaded, BackendUnavailable, error_from_chunk
from workers.caller_watch import current_caller
from workers.protocol import (
    DecodeRequest,
    GenerateRequest,
    PrefillRequest,
    PrefillResult,
    ReserveRequest,
    ReserveResult,
    TokenChunk,
    encode,
)
from workers.protocol import decode as parse

logger = logging.getLogger(__name__)
PROBE_INTERVAL_S = 0.25


def _work_tokens(req: GenerateRequest) -> int:
    return len(req.prompt_ids) + req.params.max_new_tokens


class PDBackend:
    """GenerationBackend over prefill and decode replica sets (Serve handles)."""

    def __init__(
        self,
        prefill: ReplicaSet,
        decode: ReplicaSet,
        settings: RouterSettings,
        page_size: int,
        tokenizer: SeamTokenizer,
        metrics: Metrics | None = None,
        overlap: bool = True,
    ) -> None:
        """``overlap``: stream each prefill's KV ranges to decode while it runs."""
        self.prefill, self.decode = prefill, decode
        self.overlap = overlap
        self.metrics = metrics or Metrics(Identity("router", "router", "unnamed"))
        self.settings = settings
        self.room = RoomSignal()  # wakes reservations waiting for KV room
        self.page_size = page_size
        self.lease_s = settings.prefill_timeout_s * settings.max_prefill_attempts + 10.0
        self._bg = Background()
        self.caller = current_caller()  # decode ends a stream once this router is gone
        self.targets = PDTargets(prefill, decode, settings, page_size)
        self.prefill_ranks, self.decode_ranks = self.targets.prefill, self.targets.decode
        self.prefill_health = ReplicaHealth(prefill, answers, PROBE_INTERVAL_S)
        self.decode_health = ReplicaHealth(decode, answers, PROBE_INTERVAL_S)
        self.migrator = Migrator(
            self._attempt,
            self.decode_health.wait_any_up,
            tokenizer,
            settings.max_decode_migrations,
            settings.decode_migration_wait_s,
            self.metrics,
        )

    # ---- GenerationBackend -------------------------------------------------------------
    async def generate(self, req: GenerateRequest) -> AsyncGenerator[TokenChunk, None]:
        """Stream every sequence of ``req``; n > 1 runs n PD requests side by side."""
        if req.params.n == 1:
            async with aclosing(self._one(req)) as chunks:
                async for chunk in chunks:
                    yield chunk
            return
        async with aclosing(fan_out(req, self._one)) as chunks:
            async for chunk in chunks:
                yield chunk

    async def is_healthy(self) -> bool:
        """At least one prefill and one decode replica answer within two seconds."""
        ok = await asyncio.gather(any_alive(self.prefill), any_alive(self.decode))
        return all(ok)

    # ---- one sequence ------------------------------------------------------------------
    def _one(self, req: GenerateRequest) -> AsyncGenerator[TokenChunk, None]:
        """Sequence ``req`` (n=1), migrated to another decode replica if its own fails."""
        return self.migrator.stream(req)

    async def _attempt(self, req: GenerateRequest) -> AsyncGenerator[TokenChunk, None]:
        """One reserve / prefill / decode of ``req``; raises DecodeLost if decode fails."""
        d, rank, cached_pages = await self._reserve(req)
        tokens = _work_tokens(req)
        self.decode.acquire(d, tokens)  # the rank was acquired by _reserve_until
        try:
            try:
                prefilled = await self._prefill(req, cached_pages, d)
            except BaseException:
                self._cancel_reservation(d, req.request_id)
                raise
            result = prefilled.result
            if result.kv is None:
                self._cancel_reservation(d, req.request_id)
                if result.first.error is not None:
                    raise error_from_chunk(result.first)
                yield result.first
                return
            async with aclosing(self._decode(d, prefilled, result.kv, req)) as chunks:
                async for chunk in chunks:
                    yield chunk
        finally:
            self.decode.release(d, tokens)
            self.decode_ranks.release(d, rank)
            self.room.freed()

    def _cancel_reservation(self, d: int, request_id: str) -> None:
        self._bg.submit(self.decode.handles[d].cancel_reservation.remote, request_id)

    async def _reserve(self, req: GenerateRequest) -> tuple[int, int, int]:
        """Reserve KV room on the best decode target that has it; returns the replica, its
        DP rank holding the reservation, and the prompt pages its prefix cache holds (they
        need no transfer)."""
        msg = ReserveRequest(
            request_id=req.request_id,
            num_tokens=len(req.prompt_ids),
            lease_s=self.lease_s,
            prompt_ids=req.prompt_ids,
        )
        deadline = RoomDeadline(self.settings.reserve_wait_s, self.settings.reserve_max_wait_s)
        self.metrics.waiting_for_kv.inc()
        try:
            return await self._reserve_until(msg, deadline)
        finally:
            self.metrics.waiting_for_kv.dec()

    async def _reserve_until(
        self, msg: ReserveRequest, deadline: RoomDeadline
    ) -> tuple[int, int, int]:
        """Full replicas are retried while room is being freed (``deadline``, then 429),
        each retry when this router ends a request or after a back-off
        (``router.pd.room_signal``). A replica is asked once per round (a full one fell
        back to its other ranks). When every replica failed (dead, or its engine died)
        they are marked down and the reservation waits for one to come back, as a
        migration does, at most ``decode_migration_wait_s`` in all; then it is a 503."""
        wait_until: float | None = None
        delay = RESERVE_RETRY_S
        while True:
            failures: list[str] = []
            asked: set[int] = set()
            for d, rank in self.targets.for_decode(msg.prompt_ids or []):
                if d in asked:
                    continue
                asked.add(d)
                data = encode(msg.model_copy(update={"dp_rank": rank}))
                self.decode_ranks.acquire(d, rank)  # counted while asked: concurrent asks
                try:  # spread
                    raw = await self.decode.handles[d].reserve.remote(data)
                except asyncio.CancelledError:  # the client left: a granted hold goes back
                    self._cancel_reservation(d, msg.request_id)
                    raise
                except Exception as exc:  # a dead decode replica: try the next
                    failures.append(f"{self.decode.names[d]}: {type(exc).__name__}")
                    self.decode_health.mark_down(d)
                    continue
                finally:
                    self.decode_ranks.release(d, rank, ended=False)
                reserved = parse(ReserveResult, raw)
                if reserved.ok:  # the caller releases this rank when the request ends
                    self.decode_ranks.acquire(d, reserved.dp_rank)
                    return d, reserved.dp_rank, reserved.cached_pages
                deadline.saw(d, reserved.progress)
            if len(failures) == len(self.decode.members()):
                wait_until = wait_until or time.monotonic() + self.settings.decode_migration_wait_s
                if await self.decode_health.wait_any_up(wait_until - time.monotonic()):
                    continue
                raise BackendUnavailable(
                    "no decode replica answered within router.decode_migration_wait_s: "
                    + "; ".join(failures)
                )
            left = deadline.left()
            if left <= 0:
                raise BackendOverloaded(deadline.refusal())
            if await self.room.wait(min(delay, left)):
                deadline.progress()  # a request ended here: its room went back
            else:
                delay = next_backoff(delay)  # woken by nothing: room may free elsewhere

    async def _prefill(
        self, req: GenerateRequest, skip_pages: int = 0, d: int | None = None
    ) -> _Prefilled:
        """Prefill on the policy's replica, retrying when one fails or times out; returns
        the result, the replica and the attempt id its KV is staged under (all prompt
        pages but the first ``skip_pages``; with overlap, those after its ranges, which
        decode replica ``d`` pulled while it ran or pulls at the handoff)."""
        deadline: float | None = None  # the wait starts when a try finds no replica up
        failures: list[str] = []
        tried: list[int] = []
        for attempt in range(self.settings.max_prefill_attempts):
            p, rank = self._next_prefill(req, tried)
            if deadline is None and p in self.prefill.down:
                deadline = time.monotonic() + self.settings.prefill_retry_wait_s
            wait_s = 0.0 if deadline is None else deadline - time.monotonic()
            if not await self.prefill_health.wait_up(p, wait_s):
                failures.append(f"{self.prefill.names[p]}: not back within prefill_retry_wait_s")
                break
            attempt_id = f"{req.request_id}.p{attempt}.{uuid.uuid4().hex[:8]}"
            forwarder = self._forwarder(d, req.request_id, attempt_id)
            outcome = await self._try_prefill((p, rank), req, attempt_id, skip_pages, forwarder)
            if not isinstance(outcome, str):
                return _Prefilled(outcome[0], p, attempt_id, outcome[1])
            failures.append(f"{self.prefill.names[p]}: {outcome}")
            tried.append(p)
        raise BackendUnavailable("prefill failed: " + "; ".join(failures))

    def _next_prefill(self, req: GenerateRequest, tried: list[int]) -> Target:
        """The best target whose replica was not tried yet for ``req``; when all were,
        the best one."""
        order = self.targets.for_prefill(req.prompt_ids)
        fresh = [t for t in order if t[0] not in tried]
        return fresh[0] if fresh else order[0]

    def _forwarder(self, d: int | None, request_id: str, attempt_id: str) -> RangeForwarder | None:
        if not self.overlap or d is None:
            return None
        return RangeForwarder(self.decode.handles[d], request_id, attempt_id)

    async def _try_prefill(
        self,
        target: Target,
        req: GenerateRequest,
        attempt_id: str,
        skip_pages: int = 0,
        forwarder: RangeForwarder | None = None,
    ) -> tuple[PrefillResult, list[KVHandle]] | str:
        """One attempt on ``target`` (replica, DP rank): the result and the KV ranges decode
        missed, or why it failed (the replica is then marked down). An attempt abandoned
        for any reason (failure, timeout, client gone) is released there by its id: a
        no-op if the replica never had it. With a ``forwarder`` its KV ranges go to decode
        while it runs; the result comes once they landed (or their pulls stopped)."""
        p, rank = target
        msg = encode(
            PrefillRequest(request=req, attempt_id=attempt_id, skip_pages=skip_pages, dp_rank=rank)
        )
        try:
            result = await self._prefill_on(target, msg, len(req.prompt_ids), forwarder)
            if forwarder is not None:
                await forwarder.drain()
        except BaseException as exc:
            self._bg.submit(self.prefill.handles[p].release_kv.remote, attempt_id)
            if forwarder is not None:
                forwarder.halt()
            if isinstance(exc, BackendError) or not isinstance(exc, Exception):
                raise
            self.prefill_health.mark_down(p)
            if forwarder is not None:  # the next attempt's ranges start after this one's
                await forwarder.stop()
            return prefill_failure(exc, self.settings.prefill_timeout_s)
        self.prefill_health.mark_up(p)
        if forwarder is None:
            return result, []
        if forwarder.failure is not None:
            logger.warning(
                "KV range pull of %s failed (%s); the handoff pulls its %d missed ranges",
                attempt_id, forwarder.failure, len(forwarder.missed),
            )  # fmt: skip
        return result, forwarder.missed

    async def _prefill_on(
        self, target: Target, msg: bytes, tokens: int, forwarder: RangeForwarder | None = None
    ) -> PrefillResult:
        p, rank = target
        self.prefill.acquire(p, tokens)
        self.prefill_ranks.acquire(p, rank)
        handle = self.prefill.handles[p]
        if forwarder is None:
            response = handle.prefill.remote(msg)
            work: Awaitable[Any] = await_response(response)
        else:
            response = handle.options(stream=True).prefill_stream.remote(msg)
            work = consume_prefill(response, forwarder)
        try:
            raw = await until_stalled(
                work,
                lambda: progress_of(handle),
                self.settings.prefill_stall_timeout_s,
                self.settings.prefill_timeout_s,
            )
        except BaseException:
            response.cancel()  # aborts the prefill on the replica if it is still there
            raise
        finally:
            self.prefill.release(p, tokens)
            self.prefill_ranks.release(p, rank)
        return raw if isinstance(raw, PrefillResult) else parse(PrefillResult, raw)

    async def _decode(
        self, d: int, prefilled: _Prefilled, kv: KVHandle, req: GenerateRequest
    ) -> AsyncGenerator[TokenChunk, None]:
        """Stream from decode replica ``d`` (``kv``: the prefill's staged pages, there when
        its first token did not end the request); the prefill attempt is released as soon as
        ``d`` answers (it has pulled the KV or given up). A failure of ``d`` (it died, or
        answered 503) marks it down and raises DecodeLost."""
        result, p, attempt_id = prefilled.result, prefilled.replica, prefilled.attempt_id
        first = result.first
        msg = DecodeRequest(
            request=req,
            first_token=first.token_ids[0],
            first_logprob=first.logprobs[0] if first.logprobs else 0.0,
            first_top_logprobs=first.top_logprobs[0] if first.top_logprobs else [],
            kv=kv,
            kv_ranges=prefilled.missed,
            draft=result.draft,
            cached_tokens=first.cached_tokens,
            caller=self.caller,
        )
        stream = self.decode.handles[d].options(stream=True).decode.remote(encode(msg))
        handoff_start = time.monotonic()
        released = False

        def release() -> None:  # decode answered: it has pulled the KV (or given up)
            nonlocal released
            released = True
            self.metrics.handoff_time.observe(time.monotonic() - handoff_start)
            self._bg.submit(self.prefill.handles[p].release_kv.remote, attempt_id)

        try:
            async with aclosing(
                lost_on_503(relay(stream, req.request_id, "decode replica", release))
            ) as chunks:
                async for chunk in chunks:
                    yield chunk
        except DecodeLost:
            self.decode_health.mark_down(d)
            raise
        finally:
            if not released:
                self._bg.submit(self.prefill.handles[p].release_kv.remote, attempt_id)


@dataclass(frozen=True)
class _Prefilled:
    """A prefill attempt that succeeded: its result, replica and attempt id, and the KV
    ranges of its overlapped transfer that decode did not pull while it ran."""

    result: PrefillResult
    replica: int
    attempt_id: str
    missed: list[KVHandle]
