"""The device side of a speculative step: draft chain, target verify forward, draft extend.

Per sequence, with committed tokens ``t[0..n]`` and target KV for ``0..n-1``, a step:

1. ``propose``: from the :class:`DraftState` the previous step left (``d1``, the draft's
   guess for ``t[n+1]``, and its hidden state at ``n-1``), chain ``k - 1`` more draft
   steps at positions ``n .. n+k-2``: ``d2 .. dk`` (argmax each: a deterministic draft).
   ``k`` is the item's ``num_lookahead``, so every slot written is the item's own.
2. ``verify_forward``: one target forward over ``[t[n], d1 .. dk]`` at ``n .. n+k`` for
   every decode item, batched with the step's prefill chunks; logits at every verified
   position, and the hidden states of every new token.
3. (the engine accepts, commits through the scheduler, which keeps the target KV of the
   accepted positions and leaves the rest of the lookahead to be overwritten.)
4. ``extend``: one draft forward over every position the step committed, each ``p`` with
   the target's ``h[p]`` and the now-known ``t[p+1]``. It rewrites the draft KV there
   (the chain's rows were written from draft hidden states) and, for sequences ready to
   decode, leaves the next round's :class:`DraftState`. After an all-decode step that
   verified ``k + 1`` positions everywhere it runs over all of them, a fixed shape that
   CUDA graphs capture (:mod:`~dsv3serve.engine.speculative.extend_graphs`).

So a position's draft KV always comes from the target's hidden state once committed, as
if the draft had run over the whole sequence, and pages reach the prefix cache (and PD
export) with both the target's and the draft's rows.

The eager forwards go through ``self.forwards`` (:mod:`~dsv3serve.engine.speculative.forwards`);
on rank 0 of a TP group they are broadcast so the other ranks run them too
(:mod:`~dsv3serve.engine.speculative.group`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from dsv3serve.engine.model_runner import ModelRunner
from dsv3serve.engine.scheduler.sequence import ScheduledItem, Sequence
from dsv3serve.engine.speculative.draft_quant import DraftQuant
from dsv3serve.engine.speculative.extend_graphs import ExtendGraphs
from dsv3serve.engine.speculative.forwards import SpecForwards, make_draft, spec_graphs_for
from dsv3serve.engine.speculative.graphs import SpecGraphs
from dsv3serve.forward_batch import SeqSpan

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DraftState:
    """Where a sequence's next draft chain starts; valid while it has ``num_tokens`` tokens.

    ``token`` is the draft's guess for the token after the last one, ``hidden`` [H] the
    draft's hidden state at the position of the last-but-one token (what the second
    chained step consumes). This pair is also what PD hands from prefill to decode.
    """

    num_tokens: int
    token: int
    hidden: torch.Tensor


@dataclass
class TargetPass:
    """One verify forward: ``hidden`` [T, H] of every new token, ``row_starts[i]`` the
    first row of item ``i``; ``logits`` [N, V] of every verified position of the sampled
    items, in item order (``1 + drafts`` rows per decode item, 1 per finishing prefill)."""

    hidden: torch.Tensor
    row_starts: list[int]
    logits: torch.Tensor


class SpecDecoder:
    """Speculative decoding's model work for one engine; the engine does the accepting."""

    def __init__(
        self, runner: ModelRunner, num_steps: int, draft_quant: DraftQuant | None = None
    ) -> None:
        self.runner = runner
        self.num_steps = num_steps
        self.draft = make_draft(runner, draft_quant)
        self.forwards = SpecForwards(runner, self.draft)
        self._states: dict[str, DraftState] = {}
        self.graphs: SpecGraphs | None = spec_graphs_for(runner, self.draft, num_steps)
        if runner.graphs is not None and self.graphs is None:
            logger.info("speculative rounds run eagerly under DP attention")

    def use_forwards(self, forwards: SpecForwards) -> None:
        """Run the forwards through ``forwards`` (a group leader's broadcasting ones).

        Graphed rounds need forwards whose followers replay the same graphs (a TP group's);
        DP attention's split forwards are eager only, and this rank then has no graphs.
        """
        if self.graphs is not None and not forwards.graphed:
            raise ValueError(
                f"speculative decoding: {type(forwards).__name__} runs eagerly only, but "
                "this rank captured spec graphs (expected none under DP attention)"
            )
        self.forwards = forwards

    # ---- per-sequence draft state ------------------------------------------------------
    def state(self, seq_id: str) -> DraftState | None:
        """The sequence's saved draft state, if any."""
        return self._states.get(seq_id)

    def set_state(self, seq_id: str, state: DraftState) -> None:
        """Install a draft state (PD decode side: handed over with the KV)."""
        self._states[seq_id] = state

    def retain(self, seq_ids: Iterable[str]) -> None:
        """Forget the states of sequences not in ``seq_ids`` (finished, aborted)."""
        keep = set(seq_ids)
        self._states = {k: v for k, v in self._states.items() if k in keep}

    # ---- the three forwards ------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, items: list[ScheduledItem]) -> dict[str, list[int]]:
        """Draft tokens for each decode item with lookahead and a current draft state."""
        fresh = [(item, self._fresh_state(item)) for item in items if item.num_lookahead]
        rows = [(item, st) for item, st in fresh if st is not None]
        drafts = {item.seq_id: [st.token] for item, st in rows}
        if not rows:
            return drafts
        hidden = torch.stack([st.hidden for _, st in rows])
        if self._chain_graphable([item for item, _ in rows]):
            return self._propose_graphed([item for item, _ in rows], drafts, hidden)
        for step in range(1, max(item.num_lookahead for item, _ in rows)):
            active = [i for i, (item, _) in enumerate(rows) if item.num_lookahead > step]
            spans = [
                self._chain_span(rows[i][0], drafts[rows[i][0].seq_id][-1], step) for i in active
            ]
            index = torch.tensor(active, dtype=torch.long, device=hidden.device)
            owners = [rows[i][0].seq.dp_rank for i in active]
            out, next_tokens = self.forwards.draft_step(spans, hidden[index], owners)
            hidden[index] = out.to(hidden.dtype)
            tokens = next_tokens.tolist()
            for i, token in zip(active, tokens, strict=True):
                drafts[rows[i][0].seq_id].append(token)
        return drafts

    def _chain_graphable(self, items: list[ScheduledItem]) -> bool:
        """Every row drafts the full ``k`` (the chain graph's length), within its sizes."""
        chain = None if self.graphs is None else self.graphs.chain
        return (
            chain is not None
            and chain.can_run(len(items))
            and all(item.num_lookahead == self.num_steps for item in items)
        )

    def _propose_graphed(
        self, items: list[ScheduledItem], drafts: dict[str, list[int]], hidden: torch.Tensor
    ) -> dict[str, list[int]]:
        """The ``k - 1`` chained steps of ``items`` through one padded (graphed) chain."""
        assert self.graphs is not None and self.graphs.chain is not None
        steps = [
            [
                self._chain_span(item, drafts[item.seq_id][0] if step == 1 else 0, step)
                for item in items
            ]
            for step in range(1, self.num_steps)
        ]
        tokens = self.forwards.chain_graphed(self.graphs, steps, hidden).tolist()
        for item, row in zip(items, tokens, strict=True):
            drafts[item.seq_id].extend(row)
        return drafts

    @torch.inference_mode()
    def verify_forward(
        self, items: list[ScheduledItem], drafts: dict[str, list[int]]
    ) -> TargetPass:
        """The target over every item's new tokens, decode items with their drafts."""
        spans: list[SeqSpan] = []
        rows: list[int] = []
        starts: list[int] = []
        offset = 0
        for item in items:
            tokens = item.token_ids + drafts.get(item.seq_id, [])
            spans.append(self._span(item, tokens, item.start, item.sample))
            if item.sample:
                verified = len(tokens) if item.is_decode else 1
                rows.extend(range(offset + len(tokens) - verified, offset + len(tokens)))
            starts.append(offset)
            offset += len(tokens)
        verify_only = all(item.is_decode for item in items)  # the decode (absorbed) MLA form
        graphs = self.graphs
        if verify_only and graphs is not None and graphs.verify.can_run(spans):
            # every row is verified: rows == all of them
            hidden, logits = self.forwards.verify_graphed(graphs, spans)
            return TargetPass(hidden, starts, logits)
        owners = [item.seq.dp_rank for item in items]
        hidden, logits = self.forwards.target(spans, verify_only, rows, owners)
        return TargetPass(hidden, starts, logits)

    @torch.inference_mode()
    def extend(self, items: list[ScheduledItem], target: TargetPass) -> None:
        """Draft KV for every position the step committed; next states for decode-ready.

        After an all-decode step whose items each verified ``k + 1`` positions, one padded
        draft forward over all of them (graphed where captured: see
        :mod:`~dsv3serve.engine.speculative.extend_graphs`); otherwise eager, over each
        sequence's committed positions only (ragged; the MHA extend form).
        """
        graphs = None if self.graphs is None else self.graphs.extend
        if graphs is not None and self._extend_graphable(items, target, graphs):
            self._extend_graphed(items, target, graphs)
            return
        spans: list[SeqSpan] = []
        rows: list[int] = []
        ready: list[Sequence] = []
        owners: list[int] = []
        for item, first_row in zip(items, target.row_starts, strict=True):
            seq = item.seq
            new = seq.num_computed_tokens - item.start
            if new <= 0 or not seq.page_table:
                continue  # finished or aborted before its tokens were committed
            end = item.start + new
            decode_ready = end == seq.num_tokens - 1
            next_tokens = seq.token_ids(item.start + 1, end + 1)
            spans.append(self._span(item, next_tokens, item.start, decode_ready))
            owners.append(seq.dp_rank)
            rows.extend(range(first_row, first_row + new))
            if decode_ready:
                ready.append(seq)
        if not spans:
            return
        last, drafted = self.forwards.draft_from_target(spans, target.hidden, rows, owners)
        tokens = drafted.tolist()
        for seq, token, hidden in zip(ready, tokens, last, strict=True):
            self._states[seq.seq_id] = DraftState(seq.num_tokens, token, hidden.clone())

    @staticmethod
    def _extend_graphable(
        items: list[ScheduledItem], target: TargetPass, graphs: ExtendGraphs
    ) -> bool:
        """All decode items, each with ``k + 1`` verified rows, within the graphs' sizes.

        A decode item verifies at most ``1 + k`` rows, so rows starting every ``k + 1``
        and ``n * (k + 1)`` rows in all mean each verified exactly ``k + 1``.
        """
        n, width = len(items), graphs.width
        return (
            graphs.can_run(n)
            and all(item.is_decode for item in items)
            and target.hidden.shape[0] == n * width
            and target.row_starts == list(range(0, n * width, width))
        )

    def _extend_graphed(
        self, items: list[ScheduledItem], target: TargetPass, graphs: ExtendGraphs
    ) -> None:
        """The padded extend over all ``k + 1`` positions of every item; a sequence with
        nothing committed or no pages left runs as padding and gets no state."""
        spans, rows, ready = [], [], []
        for i, item in enumerate(items):
            seq, width = item.seq, graphs.width
            new = seq.num_computed_tokens - item.start
            if new <= 0 or not seq.page_table:
                spans.append(graphs.dummy)
                rows.append(i * width)
                continue
            ids = seq.token_ids(item.start + 1, item.start + 1 + new) + [0] * (width - new)
            spans.append(self._span(item, ids, item.start, False))
            rows.append(i * width + new - 1)
            if seq.num_computed_tokens == seq.num_tokens - 1:
                ready.append((i, seq))
        assert self.graphs is not None
        hidden, tokens = self.forwards.extend_graphed(self.graphs, spans, target.hidden, rows)
        token_list = tokens.tolist()
        for i, seq in ready:
            self._states[seq.seq_id] = DraftState(seq.num_tokens, token_list[i], hidden[i])

    # ---- helpers -------------------------------------------------------------------------
    def _fresh_state(self, item: ScheduledItem) -> DraftState | None:
        state = self._states.get(item.seq_id)
        return state if state is not None and state.num_tokens == item.seq.num_tokens else None

    def _span(self, item: ScheduledItem, tokens: list[int], start: int, sample: bool) -> SeqSpan:
        """``tokens`` at ``start ..`` of the item's sequence, addressed by its page table."""
        page_table, page_size = item.seq.page_table, self.runner.cfg.page_size
        return SeqSpan.from_pages(tokens, start, page_table, page_size, sample)

    def _chain_span(self, item: ScheduledItem, token: int, step: int) -> SeqSpan:
        """Chained draft step ``step`` (1-based after d1): input ``token`` (``d[step]``) at
        position ``n+step-1``."""
        return self._span(item, [token], item.start + step - 1, True)
