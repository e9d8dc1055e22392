"""Colocated serving: each request runs whole on one replica (the baseline, small setups)."""

from __future__ import annotations

from collections.abc import AsyncIterator

from router.backend import BackendError, BackendUnavailable, error_from_chunk
from router.pd import any_alive
from router.policy import ReplicaSet
from workers.protocol import GenerateRequest, TokenChunk, encode
from workers.protocol import decode as parse


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
        seen = 0
        try:
            async for raw in stream:
                chunk = parse(TokenChunk, raw)
                if chunk.error is not None and seen == 0:
                    raise error_from_chunk(chunk)
                seen += 1
                yield chunk
        except BackendError:
            raise
        except Exception as exc:
            if seen == 0:
                raise BackendUnavailable(f"replica failed: {type(exc).__name__}") from None
            yield TokenChunk(
                request_id=req.request_id,
                finished=True,
                finish_reason="error",
                error=f"replica failed: {type(exc).__name__}",
                error_status=503,
            )
        finally:
            self.replicas.release(r, tokens)
            stream.cancel()

    async def is_healthy(self) -> bool:
        return await any_alive(self.replicas)
