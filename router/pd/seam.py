"""The seam of a migrated stream: the continuation request, and its chunks made to read as
if one engine had produced the whole stream.

A continuation prefills ``prompt + generated`` and asks for what is left of the budget.
From the seam on the router makes the text itself: it replays the tokens already streamed
through the incremental detokenizer and stop-string matcher the engine uses (primed with
the prompt, as the engine primes them), so text the old engine held back when it died (an
unfinished UTF-8 character, a possible stop-string prefix) is neither lost nor repeated,
and a stop string that spans the seam is found. The continuation itself runs without
stop strings: the router applies them, and ends the stream where the engine would have.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from dsv3serve.sampling.sampling_params import SamplingParams
from dsv3serve.sampling.stop import StopStringMatcher, check_stop_token
from dsv3serve.tokenizer.detokenizer import Decoder, IncrementalDetokenizer
from workers.protocol import GenerateRequest, TokenChunk


class SeamTokenizer(Decoder, Protocol):
    """What the seam needs from a tokenizer: ``decode`` and the EOS id."""

    @property
    def eos_token_id(self) -> int | None: ...


def unsupported(params: SamplingParams) -> str | None:
    """Why a stream with ``params`` cannot continue on another engine, or None.

    The engine keeps state of the output that a continuation (which sees the generated
    tokens as prompt) cannot rebuild: a structured-output matcher's position, and the
    output-token counts of frequency / presence penalties.
    """
    if params.constraint is not None:
        return "a structured-output constraint (response_format, tools) cannot be resumed"
    if params.frequency_penalty or params.presence_penalty:
        return "frequency / presence penalties count output tokens a continuation cannot see"
    return None


def continuation(req: GenerateRequest, generated: Sequence[int], number: int) -> GenerateRequest:
    """Request ``req`` resumed after ``generated`` tokens, as migration ``number``.

    Its id is new (``<id>.m<number>``) so nothing left of an earlier try can collide with
    it; the budget is what is left; stop strings are the router's (:class:`Seam`).
    """
    p = req.params
    left = p.max_new_tokens - len(generated)
    if left < 1:
        raise ValueError(f"{req.request_id}: no tokens left to generate ({len(generated)})")
    params = p.model_copy(
        update={
            "max_new_tokens": left,
            "min_new_tokens": max(0, p.min_new_tokens - len(generated)),
            "stop": [],
        }
    )
    return GenerateRequest(
        request_id=f"{req.request_id}.m{number}",
        prompt_ids=[*req.prompt_ids, *generated],
        params=params,
    )


class Seam:
    """Rewrites a continuation's chunks into the original stream's.

    ``generated``: the tokens streamed before the seam; ``usage``: the original stream's
    ``(prompt_tokens, cached_tokens)`` (None when nothing was streamed: the continuation's
    own counts are then the original's). When ``generated`` itself ended the stream (its
    last token was the last allowed, a stop token or completed a stop string) there is
    nothing to continue: :meth:`end` is the stream's last chunk.
    """

    def __init__(
        self,
        tokenizer: SeamTokenizer,
        req: GenerateRequest,
        generated: Sequence[int],
        usage: tuple[int, int] | None,
    ) -> None:
        self._req, self._usage = req, usage
        self._eos = tokenizer.eos_token_id
        p = req.params
        self._detok = IncrementalDetokenizer(tokenizer, req.prompt_ids, p.skip_special_tokens)
        self._stop = StopStringMatcher(p.stop)
        self.count = 0
        self.ended: str | None = None  # the finish reason when ``generated`` ended the stream
        for token in generated:  # the engine's state at the break; the text was streamed
            self.ended = self._add(token)[1]

    def end(self) -> TokenChunk:
        """The last chunk of a stream whose tokens before the seam already ended it (the
        break lost only the chunk that said so): no token, the text held back at the
        break, the engine's finish reason (:attr:`ended`)."""
        if self.ended is None:
            raise ValueError(f"{self._req.request_id}: the stream has not ended ({self.count})")
        rid = self._req.request_id
        return self.rewrite(TokenChunk(request_id=rid, finished=True, finish_reason=self.ended))

    def rewrite(self, chunk: TokenChunk) -> TokenChunk:
        """``chunk`` of the continuation as a chunk of the original stream: its text made
        here, cut at a stop string; finished when the original would have finished."""
        update: dict[str, object] = {"request_id": self._req.request_id}
        if chunk.error is not None:
            return chunk.model_copy(update=update)
        text, reason, kept = self._scan(chunk.token_ids)
        if reason is None and chunk.finished:
            reason = chunk.finish_reason  # ended without a token of its own (abort, ...)
            text += self._flush()
        update |= {
            "token_ids": chunk.token_ids[:kept],
            "text": text,
            "finished": reason is not None,
            "finish_reason": reason,
            "logprobs": chunk.logprobs[:kept],
            "top_logprobs": chunk.top_logprobs[:kept],
            "completion_tokens": self.count,
        }
        if self._usage is not None:
            update |= {"prompt_tokens": self._usage[0], "cached_tokens": self._usage[1]}
        return chunk.model_copy(update=update)

    def _scan(self, tokens: Sequence[int]) -> tuple[str, str | None, int]:
        """Text of ``tokens`` up to the first that stops: the text, the finish reason
        (None: no stop) and how many tokens were kept; the engine's rule (EOS and stop
        tokens add no text; ``max_new_tokens`` counts the whole stream)."""
        text, reason, kept = "", None, 0
        while reason is None and kept < len(tokens):
            piece, reason = self._add(tokens[kept])
            text, kept = text + piece, kept + 1
        if reason is not None:
            text += self._flush()
        return text, reason, kept

    def _add(self, token: int) -> tuple[str, str | None]:
        """One more token of the stream: its text and the finish reason it gives."""
        self.count += 1
        reason = check_stop_token(token, self.count, self._req.params, self._eos)
        if reason == "stop":
            return "", reason
        piece, hit = self._stop.feed(self._detok.add(token))
        return piece, "stop" if hit else reason

    def _flush(self) -> str:
        """At the end: the detokenizer's and the matcher's held-back text (none after a
        stop string)."""
        if self._stop.stopped:
            return ""
        return self._stop.feed(self._detok.flush())[0] + self._stop.flush()
