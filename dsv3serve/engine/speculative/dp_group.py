"""Speculative decoding under DP attention: every spec forward split by DP rank.

Rank 0's :class:`~dsv3serve.engine.speculative.loop.SpecDecoder` decides each forward of a step
(draft chain steps, the target verify, the draft extend) for the sequences of every DP
rank. :class:`DPSpecForwards` splits a call's spans by ``owners`` (the DP rank whose KV pool
holds each span), sends every rank its part in one message, runs rank 0's part, and gathers
to rank 0 alone what it needs, in span order: the logits rows of the target, the draft's
last hidden states and greedy tokens. A rank with no part runs the idle step of that
forward, so the MoE dispatch / combine (and a vocab-parallel head) stay in step.

Hidden states stay where they are needed: each rank keeps its own last target hidden
states, which the extend reads by local row; a chain step's inputs (the draft states rank 0
keeps) go point to point to the owning rank only.

Payload (int64): ``[flag, ranks, size_0 .. size_{n-1}, out_0 .. out_{n-1}]`` + per rank
:func:`~dsv3serve.engine.speculative.group.pack` of ``(0, local rows, spans)``; ``out_r``: the rows
rank ``r`` returns (for the gather). ``flag``: the verify form for ``OP_DP_SPEC_TARGET``,
``SRC_WIRE`` / ``SRC_TARGET`` for ``OP_DP_SPEC_DRAFT``.
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from dsv3serve.engine.group.dp import gather_rows, idle_logits
from dsv3serve.engine.group.tp import OpHandler, Wire, comm_device
from dsv3serve.engine.model_runner import ModelRunner
from dsv3serve.engine.speculative.draft import NextNDraft
from dsv3serve.engine.speculative.draft_quant import DraftQuant
from dsv3serve.engine.speculative.forwards import SpecForwards, make_draft
from dsv3serve.engine.speculative.group import SRC_TARGET, SRC_WIRE, pack, unpack
from dsv3serve.forward_batch import SeqSpan

OP_DP_SPEC_TARGET, OP_DP_SPEC_DRAFT = 35, 36


@dataclass(frozen=True)
class SpanSplit:
    """Where each span of a call (and each of its token rows) runs: ``owners[i]`` the DP
    rank of span ``i``, ``starts[i]`` its first row in the call, ``local_starts[i]`` its first
    row on its rank; ``by_rank[r]`` the spans of rank ``r`` in call order."""

    owners: list[int]
    starts: list[int]
    local_starts: list[int]
    by_rank: list[list[int]]

    @classmethod
    def of(cls, spans: list[SeqSpan], owners: list[int], ranks: int) -> SpanSplit:
        if len(owners) != len(spans):
            raise ValueError(f"expected an owner per span ({len(spans)}), got {len(owners)}")
        starts, local_starts, filled = [], [], [0] * ranks
        by_rank: list[list[int]] = [[] for _ in range(ranks)]
        offset = 0
        for i, (span, rank) in enumerate(zip(spans, owners, strict=True)):
            starts.append(offset)
            local_starts.append(filled[rank])
            by_rank[rank].append(i)
            offset += len(span.token_ids)
            filled[rank] += len(span.token_ids)
        return cls(owners, starts, local_starts, by_rank)

    def parts(self, spans: list[SeqSpan]) -> list[list[SeqSpan]]:
        return [[spans[i] for i in idx] for idx in self.by_rank]

    def locate(self, row: int) -> tuple[int, int]:
        """Row ``row`` of the call -> (its rank, its row on that rank)."""
        i = bisect_right(self.starts, row) - 1
        return self.owners[i], self.local_starts[i] + row - self.starts[i]

    def token_rows(self, spans: list[SeqSpan], rank: int) -> list[int]:
        """The call's rows of rank ``rank``'s tokens, in its order."""
        rows: list[int] = []
        for i in self.by_rank[rank]:
            rows.extend(range(self.starts[i], self.starts[i] + len(spans[i].token_ids)))
        return rows


def route_rows(split: SpanSplit, rows: list[int], ranks: int) -> tuple[list[list[int]], list[int]]:
    """Rows of a call -> each rank's local rows, and where each row lands in the rank-order
    concatenation of the ranks' outputs (the permutation back to ``rows``' order)."""
    local: list[list[int]] = [[] for _ in range(ranks)]
    where: list[tuple[int, int]] = []
    for row in rows:
        rank, local_row = split.locate(row)
        where.append((rank, len(local[rank])))
        local[rank].append(local_row)
    offsets = [0]
    for rows_r in local[:-1]:
        offsets.append(offsets[-1] + len(rows_r))
    return local, [offsets[rank] + j for rank, j in where]


def sampled_order(
    split: SpanSplit, spans: list[SeqSpan], ranks: int
) -> tuple[list[int], list[int]]:
    """Per rank, how many sampled spans it has; and for the call's sampled spans in order,
    their index in the rank-order concatenation of the ranks' draft outputs."""
    counts = [sum(spans[i].sample for i in idx) for idx in split.by_rank]
    offsets = [sum(counts[:r]) for r in range(ranks)]
    seen, order = [0] * ranks, []
    for span, rank in zip(spans, split.owners, strict=True):
        if span.sample:
            order.append(offsets[rank] + seen[rank])
            seen[rank] += 1
    return counts, order


def encode(flag: int, rows: list[list[int]], parts: list[list[SeqSpan]], out: list[int]) -> Tensor:
    """The payload of the module docstring."""
    blobs = [pack(0, rows_r, spans) for rows_r, spans in zip(rows, parts, strict=True)]
    head = [flag, len(parts), *(b.numel() for b in blobs), *out]
    return torch.cat([torch.tensor(head, dtype=torch.int64), *blobs])


def decode(data: Tensor, rank: int) -> tuple[int, list[int], list[SeqSpan], list[int]]:
    """Rank ``rank``'s ``(flag, local rows, spans)`` of :func:`encode`, and every rank's
    output row count."""
    flag, ranks = int(data[0]), int(data[1])
    head = data[2 : 2 + 2 * ranks].tolist()
    sizes, out = head[:ranks], head[ranks:]
    start = 2 + 2 * ranks + sum(sizes[:rank])
    _, rows, spans = unpack(data[start : start + sizes[rank]])
    return flag, rows, spans, out


class DPRankForwards:
    """One rank's part of each DP spec forward (its own spans, or the idle step)."""

    def __init__(self, runner: ModelRunner, forwards: SpecForwards) -> None:
        self.runner, self.forwards = runner, forwards
        self.target_hidden: Tensor | None = None

    def target(self, spans: list[SeqSpan], decode: bool, rows: list[int]) -> Tensor:
        """Logits [len(rows), V] of this rank's spans; keeps their hidden states."""
        if not spans:
            self.runner.model.forward_idle()
            self.target_hidden = None
            return idle_logits(self.runner)
        self.target_hidden, logits = self.forwards.target(spans, decode, rows)
        return logits

    def draft(self, spans: list[SeqSpan], hidden: Tensor | None) -> tuple[Tensor, Tensor]:
        """(last hidden [S, H], tokens [S]) of the draft over this rank's spans."""
        if not spans:
            draft = self.forwards.draft
            draft.forward_idle()
            return self._empty_hidden(), draft.compute_logits(self._empty_hidden()).argmax(-1)
        assert hidden is not None
        return self.forwards.draft_step(spans, hidden)

    def draft_from_target(self, spans: list[SeqSpan], rows: list[int]) -> tuple[Tensor, Tensor]:
        if not spans:
            return self.draft([], None)
        if self.target_hidden is None:
            raise RuntimeError("spec extend on a DP rank: expected its target forward first")
        return self.forwards.draft_from_target(spans, self.target_hidden, rows)

    def _empty_hidden(self) -> Tensor:
        width = self.runner.model_cfg.hidden_size
        return torch.empty(0, width, dtype=self.runner.dtype, device=self.runner.device)


class DPSpecForwards(SpecForwards):
    """Rank 0's spec forwards under DP attention; see the module docstring."""

    graphed = False  # eager: each DP rank runs its own part of every forward

    def __init__(self, runner: ModelRunner, draft: NextNDraft, dp_size: int) -> None:
        super().__init__(runner, draft)
        self.ranks = dp_size
        self.wire = Wire(comm_device(runner))
        self.local = DPRankForwards(runner, SpecForwards(runner, draft))
        self._target_split: SpanSplit | None = None

    def target(
        self, spans: list[SeqSpan], decode: bool, rows: list[int], owners: list[int] | None = None
    ) -> tuple[Tensor, Tensor]:
        split = SpanSplit.of(spans, owners or [0] * len(spans), self.ranks)
        local_rows, order = route_rows(split, rows, self.ranks)
        parts = split.parts(spans)
        sizes = [len(r) for r in local_rows]
        self.wire.send(OP_DP_SPEC_TARGET, encode(int(decode), local_rows, parts, sizes))
        logits = self.local.target(parts[0], decode, local_rows[0])
        gathered = gather_rows(logits, sizes, self.wire.device)
        assert gathered is not None  # rank 0 receives every rank's rows
        self._target_split = split
        placeholder = torch.empty(split.starts[-1] + len(spans[-1].token_ids) if spans else 0, 0)
        return placeholder, gathered[order].to(self.runner.device)

    def draft_step(
        self, spans: list[SeqSpan], hidden: Tensor, owners: list[int] | None = None
    ) -> tuple[Tensor, Tensor]:
        split = SpanSplit.of(spans, owners or [0] * len(spans), self.ranks)
        parts = split.parts(spans)
        counts, order = sampled_order(split, spans, self.ranks)
        self.wire.send(OP_DP_SPEC_DRAFT, encode(SRC_WIRE, [[]] * self.ranks, parts, counts))
        for rank in range(1, self.ranks):
            if parts[rank]:
                send = hidden[self._rows(split, spans, rank, hidden.device)]
                dist.send(send.to(self.wire.device, self.runner.dtype).contiguous(), rank)
        own = hidden[self._rows(split, spans, 0, hidden.device)]
        return self._gather_draft(self.local.draft(parts[0], own), counts, order)

    def draft_from_target(
        self,
        spans: list[SeqSpan],
        target_hidden: Tensor,
        rows: list[int],
        owners: list[int] | None = None,
    ) -> tuple[Tensor, Tensor]:
        if self._target_split is None:
            raise RuntimeError("spec extend under DP attention: expected a target forward first")
        split = SpanSplit.of(spans, owners or [0] * len(spans), self.ranks)
        local_rows, _ = route_rows(self._target_split, rows, self.ranks)
        parts = split.parts(spans)
        counts, order = sampled_order(split, spans, self.ranks)
        self.wire.send(OP_DP_SPEC_DRAFT, encode(SRC_TARGET, local_rows, parts, counts))
        out = self.local.draft_from_target(parts[0], local_rows[0])
        return self._gather_draft(out, counts, order)

    @staticmethod
    def _rows(split: SpanSplit, spans: list[SeqSpan], rank: int, device: torch.device) -> Tensor:
        return torch.tensor(split.token_rows(spans, rank), dtype=torch.long, device=device)

    def _gather_draft(
        self, out: tuple[Tensor, Tensor], counts: list[int], order: list[int]
    ) -> tuple[Tensor, Tensor]:
        last, tokens = out
        all_last = gather_rows(last, counts, self.wire.device)
        all_tokens = gather_rows(tokens, counts, self.wire.device)
        assert all_last is not None and all_tokens is not None
        device = self.runner.device
        return all_last[order].to(device), all_tokens[order].to(device)


class DPSpecFollower:
    """A follower rank's part of the DP spec forwards rank 0's :class:`DPSpecForwards` sent."""

    def __init__(self, runner: ModelRunner, quant: DraftQuant | None) -> None:
        self.runner = runner
        self.local = DPRankForwards(runner, SpecForwards(runner, make_draft(runner, quant)))

    def handlers(self) -> dict[int, OpHandler]:
        """The ops this follower answers, for the DP follower loop's dispatch table."""
        return {OP_DP_SPEC_TARGET: self.on_target, OP_DP_SPEC_DRAFT: self.on_draft}

    def on_target(self, wire: Wire, n: int) -> None:
        decode_form, rows, spans, sizes = decode(wire.recv(n), dist.get_rank())
        gather_rows(self.local.target(spans, bool(decode_form), rows), sizes, wire.device)

    def on_draft(self, wire: Wire, n: int) -> None:
        source, rows, spans, counts = decode(wire.recv(n), dist.get_rank())
        if source == SRC_WIRE:
            out = self.local.draft(spans, self._recv_hidden(wire, spans))
        else:
            out = self.local.draft_from_target(spans, rows)
        gather_rows(out[0], counts, wire.device)
        gather_rows(out[1], counts, wire.device)

    def _recv_hidden(self, wire: Wire, spans: list[SeqSpan]) -> Tensor | None:
        """This rank's chain-step input hidden states [T, H], sent by rank 0."""
        if not spans:
            return None
        tokens = sum(len(s.token_ids) for s in spans)
        width = self.runner.model_cfg.hidden_size
        hidden = torch.empty(tokens, width, dtype=self.runner.dtype, device=wire.device)
        dist.recv(hidden, 0)
        return hidden.to(self.runner.device)
