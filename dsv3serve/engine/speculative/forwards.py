"""The collective forwards of a speculative step, apart from the bookkeeping around them.

:class:`~dsv3serve.engine.speculative.loop.SpecDecoder` decides what to run (spans, which
hidden rows feed the draft) and keeps the per-sequence draft states; these two calls run
it. Under tensor parallelism every layer and the vocab-parallel head end in a collective,
so every rank of a group must make the same calls with the same inputs in the same order:
:mod:`~dsv3serve.engine.speculative.group` broadcasts them from rank 0.
"""

from __future__ import annotations

import torch

from dsv3serve.engine.graph_capture import GraphSetup
from dsv3serve.engine.model_runner import ModelRunner
from dsv3serve.engine.speculative.draft import NextNDraft
from dsv3serve.engine.speculative.draft_quant import DraftQuant, requantize_draft
from dsv3serve.engine.speculative.graphs import SpecGraphs
from dsv3serve.forward_batch import ForwardBatch, SeqSpan
from dsv3serve.kernels.argmax import row_argmax


def make_draft(runner: ModelRunner, quant: DraftQuant | None) -> NextNDraft:
    """The runner's NextN layer as a draft, requantized to ``quant`` where given."""
    draft = NextNDraft(runner.model)
    if quant is not None:
        requantize_draft(draft.layer, quant, runner.dtype)
    return draft


def spec_graphs_for(runner: ModelRunner, draft: NextNDraft, num_steps: int) -> SpecGraphs | None:
    """The speculative graphs of ``runner``, where its decode steps have graphs of their own
    (one rank, or a TP group whose ranks run every spec forward together: each rank
    captures the same graphs in the same order); None under DP attention, where the
    leader picks each step's graph for every rank (its spec forwards stay eager). Captured
    on CUDA; elsewhere the same padded path runs uncaptured. ``runner.close()`` releases
    them."""
    if runner.graphs is None or runner.graphs_by_group:
        return None
    setup = GraphSetup(
        runner.attn,
        runner.graphs.sizes,
        runner.scratch_slots(num_steps + 1),
        capture=runner.device.type == "cuda",
        mempool=runner.graph_pool,
    )
    graphs = SpecGraphs.build(draft, num_steps, setup)
    runner.release_on_close(graphs.release)
    return graphs


class SpecForwards:
    """Target and draft forwards of one rank, eager or through its :class:`SpecGraphs`.

    ``owners`` (one per span) names the DP rank whose KV pool holds each span; only the DP
    attention forwards (:mod:`~dsv3serve.engine.speculative.dp_group`) read it. ``graphed``:
    whether the graphed calls may be used (every rank of the group runs them together).
    """

    graphed = True

    def __init__(self, runner: ModelRunner, draft: NextNDraft) -> None:
        self.runner, self.draft = runner, draft

    # ---- through the graphs (padded static inputs; replayed where captured) ------------
    def verify_graphed(
        self, graphs: SpecGraphs, spans: list[SeqSpan]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The verify graph over ``spans`` (``k + 1`` tokens each): hidden states and
        logits of every row."""
        return graphs.verify.run(spans)

    def chain_graphed(
        self, graphs: SpecGraphs, steps: list[list[SeqSpan]], hidden: torch.Tensor
    ) -> torch.Tensor:
        """The chain graph: draft tokens [n, k - 1] (see ``DraftChainGraphs.run``)."""
        assert graphs.chain is not None
        return graphs.chain.run(steps, hidden)

    def extend_graphed(
        self,
        graphs: SpecGraphs,
        spans: list[SeqSpan],
        target_hidden: torch.Tensor,
        rows: list[int],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The extend graph over ``spans`` fed by the last verify's ``target_hidden``:
        hidden states and greedy tokens at ``rows`` (see ``ExtendGraphs.run``)."""
        assert graphs.extend is not None
        return graphs.extend.run(spans, target_hidden, rows)

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
