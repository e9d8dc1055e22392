"""Colocated serving: each request runs whole on one replica (the baseline, small setups)."""

from __future__ import annotations

from collections.abc import AsyncGenerator
from contextlib import aclosing

from router.pd.relay import relay
from router.pd.replica_calls import any_alive
from router.routing.policy import ReplicaSet
from router.routing.rank_routing import RankBoard
from workers.protocol import GenerateRequest, TokenChunk, encode


class ColocatedBackend:
    """GenerationBackend over colocated replicas: with a :class:`RankBoard` (policy
    ``rank_aware``) the best (replica, DP rank) by reported load and prefix cache, else
    the replica with the least outstanding tokens."""

    def __init__(self, replicas: ReplicaSet, ranks: RankBoard | None = None) -> None:
        self.replicas = replicas
        self.ranks = ranks

    async def generate(self, req: GenerateRequest) -> AsyncGenerator[TokenChunk, None]:
        """Stream the request from the chosen replica (and rank); closing aborts it there."""
        if self.ranks is None:
            r, rank = self.replicas.by_load()[0], None
        else:
            r, rank = self.ranks.order(req.prompt_ids)[0]
        tokens = (len(req.prompt_ids) + req.params.max_new_tokens) * req.params.n
        msg = encode(req.model_copy(update={"dp_rank": rank}))
        if self.ranks is not None:
            self.ranks.acquire(r, rank)
        self.replicas.acquire(r, tokens)
        try:  # every exit, the call's own failure included, gives the counts back
            stream = self.replicas.handles[r].options(stream=True).generate.remote(msg)
            async with aclosing(relay(stream, req.request_id, "replica")) as chunks:
                async for chunk in chunks:
                    yield chunk
        finally:
            self.replicas.release(r, tokens)
            if self.ranks is not None:
                self.ranks.release(r, rank)

    async def is_healthy(self) -> bool:
        return await any_alive(self.replicas)
