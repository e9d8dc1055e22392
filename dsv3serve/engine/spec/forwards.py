"""The collective forwards of a speculative step, apart from the bookkeeping around them.

:class:`~dsv3serve.engine.spec.loop.SpecDecoder` decides what to run (spans, which
hidden rows feed the draft) and keeps the per-sequence draft states; these two calls run
it. Under tensor parallelism every layer and the vocab-parallel head end in a collective,
so every rank of a group must make the same calls with the same inputs in the same order:
:mod:`~dsv3serve.engine.spec.group` broadcasts them from rank 0.
"""

from __future__ import annotations

import torch

from dsv3serve.engine.model_runner import ModelRunner
from dsv3serve.engine.spec.draft import NextNDraft
from dsv3serve.engine.spec.draft_quant import DraftQuant, requantize_draft
from dsv3serve.forward_batch import ForwardBatch, SeqSpan
from dsv3serve.kernels.argmax import row_argmax


def make_draft(runner: ModelRunner, quant: DraftQuant | None) -> NextNDraft:
    """The runner's NextN layer as a draft, requantized to ``quant`` where given."""
    draft = NextNDraft(runner.model)
    if quant is not None:
        requantize_draft(draft.layer, quant, runner.dtype)
    return draft


class SpecForwards:
    """Target and draft forwards of one rank (eager: the CUDA-graphed ones are apart).

    ``owners`` (one per span) names the DP rank whose KV pool holds each span; only the DP
    attention forwards (:mod:`~dsv3serve.engine.spec.dp_group`) read it.
    """

    def __init__(self, runner: ModelRunner, draft: NextNDraft) -> None:
        self.runner, self.draft = runner, draft

    @torch.inference_mode()
    def target(
        self,
        spans: list[SeqSpan],
        decode: bool,
        rows: list[int],
        owners: list[int] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The target over ``spans``: hidden states [T, H] of every token and float32
        logits [len(rows), V] of rows ``rows``. ``decode``: the absorbed (verify) form."""
        device = self.runner.device
        batch = ForwardBatch.build(spans, device, decode=decode)
        hidden = self.runner.model(batch, self.runner.attn)
        index = torch.tensor(rows, dtype=torch.long, device=device)
        return hidden, self.runner.model.compute_logits(hidden[index])

    def draft_step(
        self, spans: list[SeqSpan], hidden: torch.Tensor, owners: list[int] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The draft over ``spans`` with input hidden states ``hidden`` [T, H] (one per
        token); writes its KV. Returns the draft hidden states [S, H] at the sampled
        spans' last tokens and their greedy next tokens [S] int64 (still on the device)."""
        return self._draft(spans, hidden)

    def draft_from_target(
        self,
        spans: list[SeqSpan],
        target_hidden: torch.Tensor,
        rows: list[int],
        owners: list[int] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`draft_step` fed by rows ``rows`` of the last :meth:`target`'s hidden
        states ``target_hidden`` [T, H] (a group's followers keep their own copy)."""
        index = torch.tensor(rows, dtype=torch.long, device=target_hidden.device)
        return self._draft(spans, target_hidden[index])

    @torch.inference_mode()
    def _draft(
        self, spans: list[SeqSpan], hidden: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        batch = ForwardBatch.build(spans, self.runner.device)
        out = self.draft.forward(batch, hidden, self.runner.attn)
        last = out[batch.logits_indices]
        return last, row_argmax(self.draft.compute_logits(last))
