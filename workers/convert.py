"""Engine outputs to wire messages."""

from __future__ import annotations

from dsv3serve.engine.request import TokenOutput
from workers.protocol import TokenChunk


def chunk_from_output(out: TokenOutput) -> TokenChunk:
    """The wire form of one engine TokenOutput."""
    return TokenChunk(
        request_id=out.request_id,
        index=out.index,
        token_ids=out.token_ids,
        text=out.text,
        finished=out.finished,
        finish_reason=out.finish_reason,
        logprobs=out.logprobs,
        top_logprobs=[list(top.items()) for top in out.top_logprobs],
        prompt_tokens=out.prompt_tokens,
        completion_tokens=out.completion_tokens,
        cached_tokens=out.cached_tokens,
    )
