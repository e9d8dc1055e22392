"""Colocated serving: each request runs whole on one replica (the baseline, small setups)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import aclosing

from router.pd import any_alive
from router.policy import ReplicaSet
from router.relay import relay
from workers.protocol import GenerateRequest, TokenChunk, encode


class ColocatedBackend:
    """GenerationBackend over colocated replicas, least outstanding tokens first."""

    def __init__(self, replicas: ReplicaSet) -> None:
        self.replicas = replicas

    async def generate(self, req: GenerateRequest) -> AsyncIterator[TokenChunk]:
        """Stream the request from the least loaded replica; closing aborts it there."""
        r = self.replicas.by_load()[0]
        tokens = (len(req.prompt_ids) + req.params.max_new_tokens) * req.params.n
        self.replicas.acquire(r, tokens)
        stream = self.replicas.handles[r].options(stream=True).generate.remote(encode(req))
        try:
            async with aclosing(relay(stream, req.request_id, "replica")) as chunks:
                async for chunk in chunks:
                    yield chunk
        finally:
            self.replicas.release(r, tokens)

    async def is_healthy(self) -> bool:
        return await any_alive(self.replicas)
