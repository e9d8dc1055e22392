"""Overlapped KV transfer, the router's part: while a prefill attempt still runs, the KV
ranges it stages (pages of finished chunks) go to the decode replica holding the request's
reservation, which pulls each at once.

Pulls of one attempt go one at a time, in order (each range starts where the one before
ended). The first that fails stops the rest: that range and every later one are
:attr:`RangeForwarder.missed`, and the handoff names them (``DecodeRequest.kv_ranges``)
so the decode side pulls them before the final pages; they stay staged with the attempt.
Before the handoff the router waits for the pull in flight (:meth:`RangeForwarder.drain`),
so the decode side knows what landed when it takes over.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator
from typing import Any

from kv_transfer.handle import KVHandle
from workers.protocol import PrefillEvent, PrefillResult, PullRequest, PullResult, encode
from workers.protocol import decode as parse


class RangeForwarder:
    """Hands one prefill attempt's KV ranges to a decode replica's ``pull_kv``."""

    def __init__(self, decode: Any, request_id: str, attempt_id: str) -> None:
        """``decode``: the Serve handle of the decode replica holding the reservation."""
        self.decode, self.request_id, self.attempt_id = decode, request_id, attempt_id
        self._queue: list[KVHandle] = []
        self._task: asyncio.Task[None] | None = None
        self.failure: str | None = None
        self.missed: list[KVHandle] = []  # ranges not pulled, in order (after a failure)

    def feed(self, kv: KVHandle) -> None:
        """Queue ``kv`` for a pull after those before it; after a failure it is missed."""
        if self.failure is not None:
            self.missed.append(kv)
            return
        self._queue.append(kv)
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        while self._queue and self.failure is None:
            kv = self._queue.pop(0)
            msg = PullRequest(request_id=self.request_id, attempt_id=self.attempt_id, kv=kv)
            try:
                result = parse(PullResult, await self.decode.pull_kv.remote(encode(msg)))
            except Exception as exc:  # the decode replica died: the handoff will say so
                result = PullResult(ok=False, error=f"{type(exc).__name__}: {exc}")
            if not result.ok:
                self.failure = result.error or "range pull failed"
                self.missed, self._queue = [kv, *self._queue], []

    async def drain(self) -> None:
        """Wait until every queued range was pulled (or the pulls stopped at a failure)."""
        while self._task is not None and not self._task.done():
            await asyncio.shield(self._task)

    def halt(self) -> None:
        """Send no more ranges (the attempt is given up)."""
        self._queue.clear()
        self.failure = self.failure or "the prefill attempt was given up"

    async def stop(self) -> None:
        """:meth:`halt`, then wait out the pull in flight."""
        self.halt()
        if self._task is not None:
            with contextlib.suppress(Exception):
                await asyncio.shield(self._task)


async def consume_prefill(
    events: AsyncGenerator[Any, None], forwarder: RangeForwarder
) -> PrefillResult:
    """Feed each range of a ``prefill_stream`` to ``forwarder``; the result that ends it."""
    async for raw in events:
        event = parse(PrefillEvent, raw)
        if event.kv_range is not None:
            forwarder.feed(event.kv_range)
        elif event.result is not None:
            return event.result
    raise RuntimeError("the prefill stream ended without a result")
