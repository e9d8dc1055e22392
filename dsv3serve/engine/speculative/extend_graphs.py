"""CUDA graphs for the draft ``extend`` after an all-decode speculative step.

After a step whose every item verified ``k + 1`` positions (the verify graphs' case), the
extend runs the draft over ALL ``k + 1`` positions ``n .. n+k`` of each sequence, a fixed
shape of ``B * (k + 1)`` tokens whatever the accepted counts. Position ``p`` takes the
target's hidden state ``h[p]`` (the verify pass's row) and ``t[p+1]`` where the step
committed it, token 0 past the last committed position. Why the garbage rows are harmless:

- Attention is causal, so the committed rows' outputs (and the draft KV written there)
  do not depend on the later rows: the same values as the eager extend over the
  committed positions only.
- The rows past the last committed position write draft KV into the sequence's own
  lookahead slots, which the verify has just written with target KV for the same
  positions. Those slots lie at or past the sequence's computed length before the step,
  so on pages no prefix cache holds (the scheduler inserts only fully computed pages),
  and the sequence keeps them (``on_step_done`` frees nothing of a decode item; a
  finished sequence's pages go back in the engine's ``_emit``, after the extend). The
  next round's chain rewrites each such position before reading it, and its extend
  rewrites the ones it commits.
- A sequence without pages (finished or aborted before the extend) runs as a padding
  sequence on the scratch slots; its row is ignored.

The next round's :class:`~dsv3serve.engine.speculative.loop.DraftState` of every sequence (the
draft's hidden state and argmax token at its last committed position) is gathered on the
device through a static row index the host fills from the accepted counts. The draft
runs in the absorbed (decode) MLA form, as the verify does; the eager extend, kept for
mixed steps, prefills and shorter lookaheads, runs the MHA form; both give the same
result.
"""

from __future__ import annotations

import torch

from dsv3serve.engine.graph_capture import GraphSetup, SpanGraphs, padded_size
from dsv3serve.engine.speculative.draft import NextNDraft
from dsv3serve.forward_batch import ForwardBatch, SeqSpan
from dsv3serve.kernels.argmax import row_argmax


class ExtendGraphs(SpanGraphs[tuple[torch.Tensor, torch.Tensor]]):
    """Captured fixed-shape draft extends (``k + 1`` positions per sequence) by batch size."""

    kind = "extend"
    label = "draft-extend"

    def __init__(self, draft: NextNDraft, num_steps: int, setup: GraphSetup) -> None:
        """``setup.scratch_slots``: at least ``num_steps + 1`` slots (the verify graphs')."""
        target = draft.target
        super().__init__(setup, target.embed_tokens.weight.device, num_steps + 1, False)
        self.draft = draft
        n, dtype = self.sizes[-1], target.embed_tokens.weight.dtype
        self._hidden = torch.zeros(
            n * self.width, target.cfg.hidden_size, dtype=dtype, device=self.device
        )
        self._rows = torch.zeros(n, dtype=torch.int64, device=self.device)
        if setup.capture:
            self._capture_all(lambda size: self._load([], self._hidden[:0], [], size))

    def can_run(self, num_seqs: int) -> bool:
        return 0 < num_seqs <= self.sizes[-1]

    def _load(
        self, spans: list[SeqSpan], hidden: torch.Tensor, rows: list[int], size: int
    ) -> ForwardBatch:
        """Pad, copy token ids, positions, slots, hidden states and gather rows in; plan."""
        static = self._load_spans(spans, size)
        n = hidden.shape[0]
        self._hidden[:n].copy_(hidden)
        self._hidden[n : size * self.width].zero_()
        padded_rows = rows + [i * self.width for i in range(len(rows), size)]
        rows_host = torch.tensor(padded_rows, dtype=torch.int64)
        if self._rows.is_cuda:  # pinned and non-blocking: no stream sync in the step
            rows_host = rows_host.pin_memory()
        self._rows[:size].copy_(rows_host, non_blocking=True)
        return static

    def _forward(self, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """Hidden states [B, H] and argmax tokens [B] (int64) at the gathered rows."""
        size = batch.batch_size
        out = self.draft.forward(batch, self._hidden[: batch.num_tokens], self._attn, planned=True)
        last = out[self._rows[:size]]
        return last, row_argmax(self.draft.compute_logits(last))

    def run(
        self, spans: list[SeqSpan], hidden: torch.Tensor, rows: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The draft over ``n`` spans of ``k + 1`` tokens each; returns the hidden states
        [n, H] and argmax tokens [n] (int64) at ``rows`` (fresh tensors).

        ``spans[i]``: positions ``start .. start+k`` of sequence ``i`` (or :attr:`dummy`),
        ``hidden`` [n * (k + 1), H] the target's hidden state of each position in span
        order, ``rows[i]`` the row (into ``hidden``'s order) whose output sequence ``i``
        keeps: its last committed position.
        """
        n = len(spans)
        if hidden.shape[0] != n * self.width or len(rows) != n:
            raise ValueError(
                f"expected {n * self.width} hidden rows and {n} gather rows for {n} spans "
                f"of {self.width} tokens, got {hidden.shape[0]} and {len(rows)}"
            )
        if any(len(s.token_ids) != self.width for s in spans):
            raise ValueError(f"expected {self.width} tokens in every extend span")
        size = padded_size(self.sizes, n)
        last, tokens = self._replay(size, self._load(spans, hidden, rows, size))
        return last[:n].clone(), tokens[:n].clone()
