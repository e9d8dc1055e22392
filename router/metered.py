"""Client-visible latencies and counts, measured around any GenerationBackend."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator
from contextlib import aclosing

from dsv3serve.metrics import Metrics
from workers.backend import GenerationBackend
from workers.protocol import GenerateRequest, TokenChunk


class MeteredBackend:
    """GenerationBackend wrapper: TTFT, ITL, E2E, tokens and finish reasons."""

    def __init__(self, backend: GenerationBackend, metrics: Metrics) -> None:
        self.backend = backend
        self.m = metrics

    async def generate(self, req: GenerateRequest) -> AsyncGenerator[TokenChunk, None]:
        """``req``'s chunks, measured. Sequences still unfinished when the consumer stops
        (client gone: the stream is closed or cancelled) count as finished with
        ``abort``; a backend failure is counted where it is reported (error chunks)."""
        start = time.monotonic()
        last: dict[int, float] = {}  # per sequence index: when its last token arrived
        finished: set[int] = set()
        try:
            async with aclosing(self.backend.generate(req)) as chunks:
                async for chunk in chunks:
                    self._observe(chunk, start, last)
                    if chunk.finished:
                        finished.add(chunk.index)
                    yield chunk
        except (GeneratorExit, asyncio.CancelledError):
            for _ in range(req.params.n - len(finished)):
                self.m.finished("abort")
            raise
        finally:
            self.m.e2e.observe(time.monotonic() - start)

    def _observe(self, chunk: TokenChunk, start: float, last: dict[int, float]) -> None:
        now = time.monotonic()
        if chunk.token_ids:
            if not last:
                self.m.ttft.observe(now - start)
                self.m.prompt_tokens.inc(chunk.prompt_tokens)
            elif chunk.index in last:
                self.m.itl.observe((now - last[chunk.index]) / len(chunk.token_ids))
            last[chunk.index] = now
            self.m.generation_tokens.inc(len(chunk.token_ids))
        if chunk.finished:
            self.m.finished(chunk.finish_reason or "unknown")

    async def is_healthy(self) -> bool:
        return await self.backend.is_healthy()
