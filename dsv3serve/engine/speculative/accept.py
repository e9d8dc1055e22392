"""Verification under each request's SamplingParams: per-position processing, then accept.

Every verified position is its own sampling row: its penalties count the output so far
plus the drafts before it, and ``min_new_tokens`` counts them too, so each position sees
exactly the distribution the target would sample from without speculation; a
structured-output request brings one bitmask row per position (its grammar after the
drafts before it). Greedy rows
accept by prefix match, the others by rejection sampling (:mod:`.verify`); the committed
tokens then end at the first one that stops the request. Logprobs are those of
:class:`~dsv3serve.engine.sampler.Sampler` (penalised logits, before temperature).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from dsv3serve.engine.grammar import full_bitmask
from dsv3serve.engine.sampler import (
    SamplingBatch,
    apply_logit_controls,
    apply_penalties,
    filtered_probs,
)
from dsv3serve.engine.speculative.verify import greedy_verify, rejection_verify
from dsv3serve.kernels.argmax import row_argmax
from dsv3serve.sampling.sampling_params import SamplingParams
from dsv3serve.sampling.stop import check_stop_token


@dataclass(frozen=True)
class VerifyRequest:
    """One sequence to verify: its parameters, history and drafts (possibly none), and
    for a constrained one its host int32 bitmask [1 + len(drafts), W] (else None)."""

    params: SamplingParams
    generator: torch.Generator | None
    prompt_ids: list[int]
    output_ids: list[int]
    drafts: list[int]
    bitmask: Tensor | None = None


@dataclass(frozen=True)
class Verified:
    """What one sequence commits: ``tokens`` (1 or more) and their logprobs.

    ``num_accepted`` counts the drafts the target accepted, before the cut at a stop
    token (it measures the draft; ``tokens`` is what the request keeps).
    """

    tokens: list[int]
    num_drafts: int
    num_accepted: int
    logprobs: list[float]
    top_logprobs: list[dict[int, float]]


def mask_early_stop(
    logits: Tensor,
    params: Sequence[SamplingParams],
    num_outputs: Sequence[int],
    eos_token_id: int | None,
) -> Tensor:
    """Rows whose output is shorter than ``min_new_tokens`` may not pick EOS / stop tokens."""
    rows = [
        i for i, (p, n) in enumerate(zip(params, num_outputs, strict=True)) if n < p.min_new_tokens
    ]
    if not rows:
        return logits
    logits = logits.clone()
    for i in rows:
        banned = list(params[i].stop_token_ids)
        if not params[i].ignore_eos and eos_token_id is not None:
            banned.append(eos_token_id)
        logits[i, banned] = float("-inf")
    return logits


class SpecVerifier:
    """Turns the target's logits at every verified position into committed tokens."""

    def __init__(
        self, vocab_size: int, eos_token_id: int | None, generator: torch.Generator | None
    ) -> None:
        """``generator`` drives unseeded rows (the engine sampler's), as in the Sampler."""
        self.vocab_size, self.eos_token_id, self.generator = vocab_size, eos_token_id, generator

    def verify(self, logits: Tensor, reqs: Sequence[VerifyRequest]) -> list[Verified]:
        """``logits`` [N, V] float32: ``1 + len(drafts)`` rows per request, in order."""
        lengths = [len(r.drafts) + 1 for r in reqs]
        if logits.shape[0] != sum(lengths):
            raise ValueError(f"expected {sum(lengths)} logits rows, got {logits.shape[0]}")
        if not reqs:
            return []
        batch, logits = self._process(logits, reqs)
        index = _padded_index(lengths, logits.device)
        drafts, num_drafts = _padded_drafts(reqs, index.shape[1] - 1, logits.device)
        num_accepted, tokens = self._accept(logits, batch, reqs, index, drafts, num_drafts)
        log_norm = torch.logsumexp(logits, dim=-1)
        chosen = logits[index, tokens] - log_norm[index]  # [B, L], no [B, L, V] copy
        tops = None
        if batch.num_top_logprobs:
            values, ids = logits.topk(batch.num_top_logprobs, dim=-1)
            tops = ((values - log_norm.unsqueeze(1))[index], ids[index])
        return self._results(reqs, num_accepted, tokens, chosen, tops)

    def _process(
        self, logits: Tensor, reqs: Sequence[VerifyRequest]
    ) -> tuple[SamplingBatch, Tensor]:
        """Expand to one sampling row per position; mask early stops; apply penalties."""
        rows = [(r, j) for r in reqs for j in range(len(r.drafts) + 1)]
        outputs = [r.output_ids + r.drafts[:j] for r, j in rows]
        params = [r.params for r, _ in rows]
        logits = mask_early_stop(logits, params, [len(o) for o in outputs], self.eos_token_id)
        batch = SamplingBatch.build(
            params,
            [r.generator for r, _ in rows],
            [r.prompt_ids for r, _ in rows],
            outputs,
            self.vocab_size,
            logits.device,
            _stacked_bitmask(reqs, self.vocab_size),
        )
        logits = apply_logit_controls(logits, batch)
        if batch.penalties is not None:
            logits = apply_penalties(logits, batch.penalties)
        return batch, logits

    def _accept(
        self,
        logits: Tensor,
        batch: SamplingBatch,
        reqs: Sequence[VerifyRequest],
        index: Tensor,
        drafts: Tensor,
        num_drafts: Tensor,
    ) -> tuple[Tensor, Tensor]:
        num_accepted, tokens = greedy_verify(row_argmax(logits)[index], drafts, num_drafts)
        random_rows = [b for b, r in enumerate(reqs) if not r.params.is_greedy]
        if not random_rows:
            return num_accepted, tokens
        probs = filtered_probs(logits / batch.temperature.unsqueeze(1), batch)
        probs = probs / probs.sum(dim=-1, keepdim=True)
        sel = torch.tensor(random_rows, device=logits.device)
        picked = [reqs[b] for b in random_rows]
        uniforms, noise = self._draws(picked, drafts.shape[1], logits.device)
        acc, tok = rejection_verify(
            probs[index[sel]], drafts[sel], num_drafts[sel], uniforms, noise
        )
        num_accepted[sel], tokens[sel] = acc, tok
        return num_accepted, tokens

    def _draws(
        self, reqs: Sequence[VerifyRequest], k: int, device: torch.device
    ) -> tuple[Tensor, Tensor]:
        """U[0,1) [R, k] and Exp(1) [R, V]; seeded rows draw from their own generator."""
        uniforms = torch.rand(len(reqs), k, generator=self.generator, device=device)
        noise = torch.empty(len(reqs), self.vocab_size, device=device)
        noise.exponential_(generator=self.generator)
        for row, r in enumerate(reqs):
            if r.generator is not None:
                uniforms[row] = torch.rand(k, generator=r.generator, device=r.generator.device)
                noise[row].exponential_(generator=r.generator)
        return uniforms, noise.clamp_(min=torch.finfo(noise.dtype).tiny)

    def _results(
        self,
        reqs: Sequence[VerifyRequest],
        num_accepted: Tensor,
        tokens: Tensor,
        chosen: Tensor,
        tops: tuple[Tensor, Tensor] | None,
    ) -> list[Verified]:
        accepted, token_rows, logprob_rows = (
            num_accepted.tolist(),
            tokens.tolist(),
            chosen.tolist(),
        )
        top_rows = None if tops is None else (tops[0].tolist(), tops[1].tolist())
        out = []
        for b, r in enumerate(reqs):
            n = self._kept(r, token_rows[b][: accepted[b] + 1])
            top = [] if not r.params.logprobs or top_rows is None else _tops(top_rows, b, n, r)
            out.append(
                Verified(token_rows[b][:n], len(r.drafts), accepted[b], logprob_rows[b][:n], top)
            )
        return out

    def _kept(self, req: VerifyRequest, tokens: list[int]) -> int:
        """How many of ``tokens`` the request keeps: up to and including a stopping one."""
        done = len(req.output_ids)
        for i, token in enumerate(tokens):
            if check_stop_token(token, done + i + 1, req.params, self.eos_token_id):
                return i + 1
        return len(tokens)


def _tops(top_rows: tuple[list, list], b: int, n: int, req: VerifyRequest) -> list[dict]:
    k = req.params.logprobs or 0
    values, ids = top_rows[0][b], top_rows[1][b]
    return [dict(zip(ids[j][:k], values[j][:k], strict=True)) for j in range(n)]


def _stacked_bitmask(reqs: Sequence[VerifyRequest], vocab_size: int) -> Tensor | None:
    """The requests' bitmask rows in verify order (all ones for unconstrained ones)."""
    if all(r.bitmask is None for r in reqs):
        return None
    parts = [
        full_bitmask(len(r.drafts) + 1, vocab_size) if r.bitmask is None else r.bitmask
        for r in reqs
    ]
    for r, part in zip(reqs, parts, strict=True):
        if part.shape[0] != len(r.drafts) + 1:
            raise ValueError(
                f"expected {len(r.drafts) + 1} bitmask rows (1 + drafts), got {part.shape[0]}"
            )
    return torch.cat(parts)


def _padded_index(lengths: list[int], device: torch.device) -> Tensor:
    """[B, L] flat row of position j of request b (padding repeats its last row)."""
    width = max(lengths)
    starts = torch.tensor([0, *lengths[:-1]], device=device).cumsum(0)
    last = torch.tensor(lengths, device=device) - 1
    j = torch.arange(width, device=device)
    return starts.unsqueeze(1) + torch.minimum(j.unsqueeze(0), last.unsqueeze(1))


def _padded_drafts(
    reqs: Sequence[VerifyRequest], k: int, device: torch.device
) -> tuple[Tensor, Tensor]:
    drafts = torch.zeros(len(reqs), k, dtype=torch.long)
    for b, r in enumerate(reqs):
        drafts[b, : len(r.drafts)] = torch.tensor(r.drafts, dtype=torch.long)
    num_drafts = torch.tensor([len(r.drafts) for r in reqs])
    return drafts.to(device), num_drafts.to(device)
