"""CUDA graphs for MTP speculative decoding: the target verify and the chained draft steps.

Both pad a step of ``b`` sequences to a captured size ``B >= b`` as
:class:`~dsv3serve.engine.cuda_graph.DecodeGraphs` does, with the same helpers
(:mod:`dsv3serve.engine.graph_capture`) and memory pool:

- :class:`VerifyGraphs`: the target over ``k + 1`` tokens per sequence (``[t_n, d1..dk]``)
  of an all-decode step, logits at every row and the hidden states ``extend`` reads. A
  padding sequence is ``k + 1`` tokens at positions ``0..k`` on the scratch pages, which
  must hold ``k + 1`` slots (``ModelRunner`` reserves ``ceil((k + 1) / page_size)`` pages).
- :class:`DraftChainGraphs`: all ``k - 1`` chained draft steps of a round in ONE graph:
  each step's argmax feeds the next step's token ids on the device, its hidden state the
  next step's hidden input; the positions and slots of every step are known before the
  chain starts (the scheduler allocated the lookahead), so every step is planned before
  the replay, each on its own attention fork (its own flashinfer graph wrappers). A
  padding sequence is one token at position 0 of the scratch page in every step.

Mixed steps (prefill chunks beside decode), rows with fewer drafts than ``k``, and
batches over the largest size stay eager. The draft extend after a verify of this kind
has graphs of its own (:mod:`dsv3serve.engine.speculative.extend_graphs`).
"""

from __future__ import annotations

import dataclasses
import logging

import torch

from dsv3serve.engine.graph_capture import (
    GraphCache,
    GraphSetup,
    SpanGraphs,
    fork_attention,
    pad_spans,
    padded_size,
    plan_for_graph,
)
from dsv3serve.engine.speculative.draft import NextNDraft
from dsv3serve.engine.speculative.extend_graphs import ExtendGraphs
from dsv3serve.engine.static_inputs import StaticInputs
from dsv3serve.forward_batch import ForwardBatch, SeqSpan
from dsv3serve.kernels.argmax import row_argmax
from dsv3serve.model.deepseek_v3 import DeepseekV3ForCausalLM

logger = logging.getLogger(__name__)


class VerifyGraphs(SpanGraphs[tuple[torch.Tensor, torch.Tensor]]):
    """Captured verify forwards (target + LM head on every row) for each of ``sizes``."""

    kind = "verify"
    label = "verify"

    def __init__(self, model: DeepseekV3ForCausalLM, num_steps: int, setup: GraphSetup) -> None:
        """``setup.scratch_slots``: at least ``num_steps + 1`` slots."""
        super().__init__(setup, model.embed_tokens.weight.device, num_steps + 1, True)
        self.model = model
        if setup.capture:
            self._capture_all(lambda size: self._load_spans([], size))

    def can_run(self, spans: list[SeqSpan]) -> bool:
        """``k + 1`` tokens and logits for each decode span, within the largest size."""
        return 0 < len(spans) <= self.sizes[-1] and all(
            len(s.token_ids) == self.width and s.sample for s in spans
        )

    def _forward(self, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = self.model(batch, self._attn, planned=True)
        return hidden, self.model.compute_logits(hidden)

    def run(self, spans: list[SeqSpan]) -> tuple[torch.Tensor, torch.Tensor]:
        """Hidden states [n, H] and logits [n, V] (float32) of every row, ``n =
        len(spans) * (k + 1)``, span by span (fresh tensors, not the graph's buffers)."""
        size = padded_size(self.sizes, len(spans))
        hidden, logits = self._replay(size, self._load_spans(spans, size))
        rows = len(spans) * self.width
        return hidden[:rows].clone(), logits[:rows].clone()


class DraftChainGraphs:
    """The ``k - 1`` chained draft steps of a round, captured as one graph per size."""

    def __init__(self, draft: NextNDraft, num_steps: int, setup: GraphSetup) -> None:
        """Padding sequences write to ``setup.scratch_slots[0]`` in every step."""
        if num_steps < 2:
            raise ValueError(f"a draft chain needs num_steps >= 2, got {num_steps}")
        self.draft, self.chain, self.sizes = draft, num_steps - 1, sorted(setup.sizes)
        scratch_slot = setup.scratch_slots[0]
        target = draft.target
        self.device = target.embed_tokens.weight.device
        n = self.sizes[-1]
        self._dummy = SeqSpan([0], 0, [scratch_slot], True)
        self._steps = [StaticInputs(n, scratch_slot, self.device) for _ in range(self.chain)]
        self._attns = [fork_attention(setup.attn, f"draft{s}") for s in range(self.chain)]
        dtype = target.embed_tokens.weight.dtype
        self._hidden = torch.zeros(n, target.cfg.hidden_size, dtype=dtype, device=self.device)
        self._graphs: GraphCache[torch.Tensor] = GraphCache(self.device, setup.mempool)
        self.runs = 0  # chains through the padded path (replayed or not)
        if setup.capture:
            for size in reversed(self.sizes):
                batches = self._load([[] for _ in range(self.chain)], self._hidden[:0], size)
                self._graphs.capture(size, lambda b=batches: self._forward(b))
            logger.info("captured draft-chain CUDA graphs for batch sizes %s", self.sizes)

    @property
    def replays(self) -> int:
        """Draft chains served by a graph."""
        return self._graphs.replays

    def can_run(self, num_seqs: int) -> bool:
        return 0 < num_seqs <= self.sizes[-1]

    def _load(
        self, steps: list[list[SeqSpan]], hidden: torch.Tensor, size: int
    ) -> list[ForwardBatch]:
        """Pad and plan every step; copy the first hidden states in (zeros for padding)."""
        batches = []
        for spans, inputs, attn in zip(steps, self._steps, self._attns, strict=True):
            padded = pad_spans(spans, size, self._dummy)
            static = inputs.build(padded)
            plan_for_graph(attn, static)
            batches.append(static)
        n = hidden.shape[0]
        self._hidden[:n].copy_(hidden)
        self._hidden[n:size].zero_()
        return batches

    def _forward(self, batches: list[ForwardBatch]) -> torch.Tensor:
        """Tokens [B, k - 1] (int64): each step's argmax, fed to the next step."""
        ids, hidden = batches[0].input_ids, self._hidden[: batches[0].num_tokens]
        tokens = []
        for batch, attn in zip(batches, self._attns, strict=True):
            step = dataclasses.replace(batch, input_ids=ids)
            hidden = self.draft.forward(step, hidden, attn, planned=True)
            ids = row_argmax(self.draft.compute_logits(hidden))
            tokens.append(ids)
        return torch.stack(tokens, dim=1)

    def run(self, steps: list[list[SeqSpan]], hidden: torch.Tensor) -> torch.Tensor:
        """Draft tokens [n, k - 1] (int64) of ``n`` sequences.

        ``steps[s]`` holds each sequence's span of chained step ``s + 1``: one token at its
        position (the token itself matters only in step 0: ``d1``; later steps take the
        previous step's argmax); ``hidden`` [n, H] the hidden states step 0 consumes.
        """
        if len(steps) != self.chain:
            raise ValueError(f"expected spans of {self.chain} chained steps, got {len(steps)}")
        n = hidden.shape[0]
        size = padded_size(self.sizes, n)
        batches = self._load(steps, hidden, size)
        tokens = self._graphs.run(size, lambda: self._forward(batches))
        self.runs += 1
        return tokens[:n].clone()


@dataclasses.dataclass
class SpecGraphs:
    """The verify and draft-extend graphs, and the draft-chain graphs when ``k >= 2``."""

    verify: VerifyGraphs
    chain: DraftChainGraphs | None
    extend: ExtendGraphs | None = None

    @classmethod
    def build(cls, draft: NextNDraft, num_steps: int, setup: GraphSetup) -> SpecGraphs:
        """Capture (or with ``setup.capture=False`` only prepare) every kind of graph;
        ``setup.scratch_slots``: at least ``num_steps + 1`` slots."""
        verify = VerifyGraphs(draft.target, num_steps, setup)
        chain = DraftChainGraphs(draft, num_steps, setup) if num_steps >= 2 else None
        return cls(verify, chain, ExtendGraphs(draft, num_steps, setup))
