"""A fake model for the chat-output tests: it streams the tokens of a given text.

The tiny model has random weights, so it cannot be made to write a tool call or close
``</think>`` on demand. ``FakeScriptedBackend`` stands in for the model only: the text is
tokenized by the real DeepSeek tokenizer and streamed through the real incremental
detokenizer, ``tokens_per_chunk`` tokens per chunk (1 like plain decoding, more like
PD's first chunk or speculative decoding), with the real request's prompt as context.
Everything in front of it (HTTP, validation, the template, the parsers, SSE) is real.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

from dsv3serve.tokenizer.detokenizer import IncrementalDetokenizer
from dsv3serve.tokenizer.tokenizer import Tokenizer
from workers.protocol import GenerateRequest, TokenChunk

Script = Callable[[GenerateRequest, int], str]  # (request, choice index) -> output text


class FakeScriptedBackend:
    """A GenerationBackend whose "model" writes ``script``'s text; it records requests."""

    def __init__(self, tokenizer: Tokenizer, script: Script, tokens_per_chunk: int = 1) -> None:
        self.tokenizer = tokenizer
        self.script = script
        self.tokens_per_chunk = tokens_per_chunk
        self.requests: list[GenerateRequest] = []

    def output_ids(self, req: GenerateRequest, index: int) -> list[int]:
        """The ids the fake model writes for choice ``index`` (cut at max_new_tokens)."""
        ids = self.tokenizer.encode(self.script(req, index), add_bos=False)
        return ids[: req.params.max_new_tokens]

    async def generate(self, req: GenerateRequest) -> AsyncIterator[TokenChunk]:
        self.requests.append(req)
        for index in range(req.params.n):
            for chunk in self._choice_chunks(req, index):
                yield chunk

    def _choice_chunks(self, req: GenerateRequest, index: int) -> list[TokenChunk]:
        ids = self.output_ids(req, index)
        full = len(self.tokenizer.encode(self.script(req, index), add_bos=False))
        reason = "length" if full > len(ids) else "stop"
        skip = req.params.skip_special_tokens
        detok = IncrementalDetokenizer(self.tokenizer, req.prompt_ids, skip)
        step = self.tokens_per_chunk
        chunks = []
        for start in range(0, len(ids), step):
            part = ids[start : start + step]
            last = start + step >= len(ids)
            text = detok.add_many(part) + (detok.flush() if last else "")
            chunks.append(
                TokenChunk(
                    request_id=req.request_id,
                    index=index,
                    token_ids=part,
                    text=text,
                    finished=last,
                    finish_reason=reason if last else None,
                    prompt_tokens=len(req.prompt_ids),
                    completion_tokens=start + len(part),
                )
            )
        return chunks

    async def is_healthy(self) -> bool:
        return True
