"""Decode-loss migration: a stream whose decode replica fails continues on another.

The router keeps each sequence's streamed token ids. When its decode replica fails (the
stream breaks because the replica died, or the replica answers 503: its engine died or
the KV handoff failed), the stream is prefilled again, prompt + tokens so far, and
decoded on a decode replica that is up (another one, or the same one once Serve has
restarted it; with none up it waits at most ``router.decode_migration_wait_s``), with what
is left of ``max_tokens``; at most ``router.max_decode_migrations`` times per sequence.
The client sees one stream (``router.pd.seam``): greedy text equals the run without the
fault. A sampled stream continues with a fresh RNG position (a seeded one restarts its
seed's random stream at the seam, as at the prefill-to-decode handoff), so it is a valid
sample but not the text the unbroken run would have drawn. Streams with a structured-output
constraint or frequency / presence penalties are not migrated (``seam.unsupported``). A
stream lost after its last token (the last of ``max_tokens``, a stop token or one that
completes a stop string) but before the chunk that ended it has nothing left to generate:
it ends as the engine would have ended it, with the text held back at the break.

Failures: past the bound, or when the continuation cannot start, a stream that has
streamed tokens ends with an in-band error chunk (as without migration); one that has not
gets the error raised (the HTTP layer answers with its status).
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from contextlib import aclosing

from dsv3serve.metrics import Metrics
from router.pd.seam import Seam, SeamTokenizer, continuation, unsupported
from workers.backend import BackendError, BackendUnavailable
from workers.protocol import GenerateRequest, TokenChunk, error_chunk

Attempt = Callable[[GenerateRequest], AsyncGenerator[TokenChunk, None]]
WaitForDecode = Callable[[float], Awaitable[bool]]  # timeout_s -> whether one is up


class DecodeLost(Exception):
    """The decode side of a stream failed: its replica died, or answered 503."""


class StreamLog:
    """What one sequence has streamed to its client so far."""

    def __init__(self) -> None:
        self.token_ids: list[int] = []
        self.usage: tuple[int, int] | None = None  # (prompt_tokens, cached_tokens)

    def add(self, chunk: TokenChunk) -> None:
        """Record a chunk the client is about to get."""
        if self.usage is None:
            self.usage = (chunk.prompt_tokens, chunk.cached_tokens)
        self.token_ids += chunk.token_ids

    @property
    def started(self) -> bool:
        """Whether the client has had a chunk (errors must then come in-band)."""
        return self.usage is not None


class Migrator:
    """Runs a sequence through ``attempt`` (one reserve / prefill / decode), continuing it
    after a :class:`DecodeLost` as the module docstring says."""

    def __init__(
        self,
        attempt: Attempt,
        wait_for_decode: WaitForDecode,
        tokenizer: SeamTokenizer,
        max_migrations: int,
        wait_s: float,
        metrics: Metrics,
    ) -> None:
        self._attempt, self._wait_for_decode = attempt, wait_for_decode
        self._tokenizer, self._metrics = tokenizer, metrics
        self.max_migrations, self.wait_s = max_migrations, wait_s

    async def stream(self, req: GenerateRequest) -> AsyncGenerator[TokenChunk, None]:
        """Every chunk of sequence ``req`` (n=1), across decode failures."""
        log, current, seam = StreamLog(), req, None
        broke_at: float | None = None
        for number in range(self.max_migrations + 1):
            try:
                async with aclosing(self._attempt(current)) as chunks:
                    async for chunk in chunks:
                        out = chunk if seam is None else seam.rewrite(chunk)
                        if broke_at is not None:
                            self._metrics.migration_time.observe(time.monotonic() - broke_at)
                            broke_at = None
                        log.add(out)
                        yield out
                        if out.finished:
                            return
                return
            except DecodeLost as exc:
                lost, broke_at = exc, time.monotonic()
            except BackendError as exc:  # e.g. a continuation's reserve or prefill failed
                if number > 0:
                    self._metrics.migration_failed("failed")
                if not log.started:
                    raise
                yield error_chunk(req.request_id, exc.message, exc.status)
                return
            seam = Seam(self._tokenizer, req, log.token_ids, log.usage)
            if seam.ended is not None:  # lost after its last token: only the end was missing
                yield seam.end()
                return
            reason = await self._cannot_continue(req, log, number)
            if reason is not None:
                async for end in self._give_up(req, log, f"{lost}{reason[1]}", reason[0]):
                    yield end
                return
            self._metrics.migrations.inc()
            current = continuation(req, log.token_ids, number + 1)

    async def _cannot_continue(
        self, req: GenerateRequest, log: StreamLog, number: int
    ) -> tuple[str, str] | None:
        """Why the stream cannot migrate now, as (metric reason, message tail), or None."""
        if number >= self.max_migrations:
            bound = f"router.max_decode_migrations ({self.max_migrations})"
            return "exhausted", f"; not migrated again: {bound} reached"
        why = unsupported(req.params)
        if why is not None:
            return "unsupported", f"; not migrated: {why}"
        if not await self._wait_for_decode(self.wait_s):
            wait = f"router.decode_migration_wait_s ({self.wait_s:g} s)"
            return "no_decode", f"; no decode replica came back within {wait}"
        return None

    async def _give_up(
        self, req: GenerateRequest, log: StreamLog, message: str, reason: str
    ) -> AsyncGenerator[TokenChunk, None]:
        """End the stream: an in-band error after a chunk, else the error raised."""
        self._metrics.migration_failed(reason)
        if not log.started:
            raise BackendUnavailable(message)
        yield error_chunk(req.request_id, message, 503)
