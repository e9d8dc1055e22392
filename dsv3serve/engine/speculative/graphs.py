"""CUDA graphs for MTP speculative decoding: the target verify and the chained draft steps.

Both pad a step of ``b`` sequences to a captured size ``B >= b`` as
:class:`~dsv3serve.engine.cuda_graph.DecodeGraphs` does, with the same helpers
(:mod:`dsv3serve.engine.graph_capture`) and memory pool:

- :class:`VerifyGraphs`: the target over ``k + 1`` tokens per sequence (``[t_n, d1..dk]``)
  of an all-decode step, logits at every row and the hidden states ``extend`` reads. A
  padding sequence is ``k + 1`` tokens at positions ``0..k`` on the scratch pages, which
  must hold ``k + 1`` slots (``ModelRunner`` reserves ``ceil((k + 1) / page_size)`` pages).
- :class:`DraftChainGraphs`: the ``k - 1`` chained draft steps of a round, one graph per
  step: each step's argmax feeds the next step's token ids on the device, its hidden state
  the next step's hidden input (through buffers outside the graphs' pool). The positions
  and slots of every step are known before the chain starts (the scheduler allocated the
  lookahead), and each step plans on its own attention fork (its own flashinfer graph
  wrappers), so step ``s + 1`` is padded, copied and planned on the host while step ``s``
  runs: the chain costs one step's host work, not ``k - 1``. A padding sequence is one
  token at position 0 of the scratch page in every step.

Mixed steps (prefill chunks beside decode), rows with fewer drafts than ``k``, and
batches over the largest size stay eager. The draft extend after a verify of this kind
has graphs of its own (:mod:`dsv3serve.engine.speculative.extend_graphs`).
"""

from __future__ import annotations

import dataclasses
import logging
from functools import partial

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
    """The ``k - 1`` chained draft steps of a round: one graph per step and size, launched
    one after another, each step's host work (padding, inputs, attention plan) done while
    the step before it runs on the device."""

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
        # carried from step to step outside the graphs' pool (a replay overwrites the
        # pool's outputs): the hidden states, the last argmax, every step's tokens
        self._hidden = torch.zeros(n, target.cfg.hidden_size, dtype=dtype, device=self.device)
        self._ids = torch.zeros(n, dtype=torch.int64, device=self.device)
        self._tokens = torch.zeros(n, self.chain, dtype=torch.int64, device=self.device)
        self._graphs: list[GraphCache[torch.Tensor]] = [
            GraphCache(self.device, setup.mempool) for _ in range(self.chain)
        ]
        self.runs = 0  # chains through the padded path (replayed or not)
        if setup.capture:
            for size in reversed(self.sizes):
                self._load_hidden(self._hidden[:0], size)
                for step, graphs in enumerate(self._graphs):
                    batch = self._load_step(step, [], size)
                    graphs.capture(size, partial(self._forward_step, step, batch))
            logger.info("captured draft-chain CUDA graphs for batch sizes %s", self.sizes)

    @property
    def replays(self) -> int:
        """Draft chains served by graphs."""
        return self._graphs[0].replays

    def can_run(self, num_seqs: int) -> bool:
        return 0 < num_seqs <= self.sizes[-1]

    def release(self) -> None:
        """Free every step's captured graphs (later chains run eagerly)."""
        for graphs in self._graphs:
            graphs.release()

    def _load_step(self, step: int, spans: list[SeqSpan], size: int) -> ForwardBatch:
        """Pad step ``step``'s spans, copy them into its static inputs and plan its fork."""
        static = self._steps[step].build(pad_spans(spans, size, self._dummy))
        plan_for_graph(self._attns[step], static)
        return static

    def _load_hidden(self, hidden: torch.Tensor, size: int) -> None:
        """The hidden states step 0 consumes (zeros for padding)."""
        n = hidden.shape[0]
        self._hidden[:n].copy_(hidden)
        self._hidden[n:size].zero_()

    def _forward_step(self, step: int, batch: ForwardBatch) -> torch.Tensor:
        """One draft step over the carried hidden states; step 0 reads its token ids from
        the batch, a later one the step before's argmax. Returns the tokens [B, k - 1]."""
        n = batch.num_tokens
        ids = batch.input_ids if step == 0 else self._ids[:n]
        hidden = self.draft.forward(
            dataclasses.replace(batch, input_ids=ids), self._hidden[:n], self._attns[step], True
        )
        ids = row_argmax(self.draft.compute_logits(hidden))
        self._hidden[:n].copy_(hidden)
        self._ids[:n].copy_(ids)
        self._tokens[:n, step].copy_(ids)
        return self._tokens

    def run(self, steps: list[list[SeqSpan]], hidden: torch.Tensor) -> torch.Tensor:
        """Draft tokens [n, k - 1] (int64) of ``n`` sequences.

        ``steps[s]`` holds each sequence's span of chained step ``s + 1``: one token at its
        position (the token itself matters only in step 0: ``d1``; later steps take the
        previous step's argmax); ``hidden`` [n, H] the hidden states step 0 consumes.
        Step ``s + 1`` is loaded after step ``s`` is launched: its copies and plan follow
        step ``s`` on the stream, and the host prepares them while the device runs it.
        """
        if len(steps) != self.chain:
            raise ValueError(f"expected spans of {self.chain} chained steps, got {len(steps)}")
        n = hidden.shape[0]
        size = padded_size(self.sizes, n)
        self._load_hidden(hidden, size)
        batch = self._load_step(0, steps[0], size)
        for step, graphs in enumerate(self._graphs):
            graphs.run(size, partial(self._forward_step, step, batch))
            if step + 1 < self.chain:
                batch = self._load_step(step + 1, steps[step + 1], size)
        self.runs += 1
        return self._tokens[:n].clone()


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

    def release(self) -> None:
        """Free every captured graph: a group's ranks do before they leave the process group
        (:meth:`ModelRunner.close`), as the graphs' collectives hold the communicator."""
        for graphs in (self.verify, self.chain, self.extend):
            if graphs is not None:
                graphs.release()
