"""Speculative decoding in a tensor-parallel group: rank 0 broadcasts each spec forward.

Rank 0's :class:`~dsv3serve.engine.speculative.loop.SpecDecoder` decides every forward of a
step (draft chain steps, the target verify, the draft extend). Each one is collective
under TP, so :class:`GroupSpecForwards` broadcasts it over the group's
:class:`~dsv3serve.engine.group.tp.Wire` before running it, and a follower's
:class:`SpecFollower` runs the same call with the same inputs. The followers keep no
per-sequence state: a chain step's input hidden states (from rank 0's draft states) come
over the wire; the extend reads rows of the follower's own last target hidden states,
which equal rank 0's (every TP layer ends in an all-reduce).

Payload (int64): ``[flag, n_rows, rows..., spans...]`` with the spans of
:func:`~dsv3serve.engine.group.tp.encode_spans`. ``OP_SPEC_TARGET``: flag 1 for the
absorbed (verify) form, rows the logits rows. ``OP_SPEC_DRAFT``: flag ``SRC_WIRE`` (then
a second broadcast of the input hidden states [T, H] in the compute dtype) or
``SRC_TARGET`` (rows of the last target hidden states).

Rounds through the speculative graphs (:class:`~dsv3serve.engine.speculative.graphs.SpecGraphs`,
which every rank of a TP group builds, and on CUDA captures, in the same order) go as
``OP_SPEC_GRAPH``: flag ``GRAPH_VERIFY`` (the spans), ``GRAPH_CHAIN`` (rows ``[n]``, the
spans of every chained step one after the other, then a broadcast of the input hidden
states [n, H]) or ``GRAPH_EXTEND`` (rows: the rows gathered; the spans). Each rank pads
the same spans the same way, so all replay the same graph.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from dsv3serve.engine.group.tp import OpHandler, Wire, comm_device, decode_spans, encode_spans
from dsv3serve.engine.model_runner import ModelRunner
from dsv3serve.engine.speculative.draft import NextNDraft
from dsv3serve.engine.speculative.draft_quant import DraftQuant
from dsv3serve.engine.speculative.forwards import SpecForwards, make_draft, spec_graphs_for
from dsv3serve.engine.speculative.graphs import SpecGraphs
from dsv3serve.forward_batch import SeqSpan

OP_SPEC_TARGET, OP_SPEC_DRAFT, OP_SPEC_GRAPH = 33, 34, 37
SRC_WIRE, SRC_TARGET = 0, 1
GRAPH_VERIFY, GRAPH_CHAIN, GRAPH_EXTEND = 0, 1, 2  # the flag of an OP_SPEC_GRAPH


def pack(flag: int, rows: list[int], spans: list[SeqSpan]) -> torch.Tensor:
    """``[flag, len(rows), rows..., encode_spans(spans)...]`` as one int64 tensor."""
    head = torch.tensor([flag, len(rows), *rows], dtype=torch.int64)
    return torch.cat([head, encode_spans(spans)])


def unpack(data: torch.Tensor) -> tuple[int, list[int], list[SeqSpan]]:
    """Inverse of :func:`pack`: (flag, rows, spans)."""
    flag, n_rows = data[:2].tolist()
    return flag, data[2 : 2 + n_rows].tolist(), decode_spans(data[2 + n_rows :])


class GroupSpecForwards(SpecForwards):
    """Rank 0's spec forwards: each call goes to the followers, then runs here."""

    def __init__(self, runner: ModelRunner, draft: NextNDraft) -> None:
        super().__init__(runner, draft)
        self.wire = Wire(comm_device(runner))

    def target(
        self,
        spans: list[SeqSpan],
        decode: bool,
        rows: list[int],
        owners: list[int] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self.wire.send(OP_SPEC_TARGET, pack(int(decode), rows, spans))
        return super().target(spans, decode, rows)

    def draft_step(
        self, spans: list[SeqSpan], hidden: torch.Tensor, owners: list[int] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self.wire.send(OP_SPEC_DRAFT, pack(SRC_WIRE, [], spans))
        dist.broadcast(hidden.to(self.wire.device, self.runner.dtype).contiguous(), src=0)
        return super().draft_step(spans, hidden)

    def draft_from_target(
        self,
        spans: list[SeqSpan],
        target_hidden: torch.Tensor,
        rows: list[int],
        owners: list[int] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self.wire.send(OP_SPEC_DRAFT, pack(SRC_TARGET, rows, spans))
        return super().draft_from_target(spans, target_hidden, rows)

    def verify_graphed(
        self, graphs: SpecGraphs, spans: list[SeqSpan]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self.wire.send(OP_SPEC_GRAPH, pack(GRAPH_VERIFY, [], spans))
        return super().verify_graphed(graphs, spans)

    def chain_graphed(
        self, graphs: SpecGraphs, steps: list[list[SeqSpan]], hidden: torch.Tensor
    ) -> torch.Tensor:
        flat = [span for step in steps for span in step]
        self.wire.send(OP_SPEC_GRAPH, pack(GRAPH_CHAIN, [len(hidden)], flat))
        dist.broadcast(hidden.to(self.wire.device, self.runner.dtype).contiguous(), src=0)
        return super().chain_graphed(graphs, steps, hidden)

    def extend_graphed(
        self,
        graphs: SpecGraphs,
        spans: list[SeqSpan],
        target_hidden: torch.Tensor,
        rows: list[int],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self.wire.send(OP_SPEC_GRAPH, pack(GRAPH_EXTEND, rows, spans))
        return super().extend_graphed(graphs, spans, target_hidden, rows)


class SpecFollower:
    """A follower rank's spec forwards: runs what rank 0's :class:`GroupSpecForwards` sent."""

    def __init__(self, runner: ModelRunner, quant: DraftQuant | None, num_steps: int) -> None:
        """``num_steps``: the group's ``speculative_num_steps`` (the graphs' shapes)."""
        self.runner = runner
        draft = make_draft(runner, quant)
        self.forwards = SpecForwards(runner, draft)
        self.graphs = spec_graphs_for(runner, draft, num_steps)  # as rank 0's, same order
        self._target_hidden: torch.Tensor | None = None

    def handlers(self) -> dict[int, OpHandler]:
        """The ops this follower answers, for the follower loop's dispatch table."""
        return {
            OP_SPEC_TARGET: self.on_target,
            OP_SPEC_DRAFT: self.on_draft,
            OP_SPEC_GRAPH: self.on_graph,
        }

    def on_graph(self, wire: Wire, n: int) -> None:
        """Replay the speculative graph rank 0 replays, with the same inputs."""
        kind, rows, spans = unpack(wire.recv(n))
        graphs, forwards = self.graphs, self.forwards
        if graphs is None:
            raise RuntimeError("spec graph op: this follower built no speculative graphs")
        if kind == GRAPH_VERIFY:
            self._target_hidden = forwards.verify_graphed(graphs, spans)[0]
        elif kind == GRAPH_CHAIN:
            width = rows[0]
            steps = [spans[i : i + width] for i in range(0, len(spans), width)]
            forwards.chain_graphed(graphs, steps, self._recv_hidden(wire, steps[0]))
        elif self._target_hidden is None:
            raise RuntimeError("spec graph extend: expected a target forward first")
        else:
            forwards.extend_graphed(graphs, spans, self._target_hidden, rows)

    def on_target(self, wire: Wire, n: int) -> None:
        decode, rows, spans = unpack(wire.recv(n))
        self._target_hidden = self.forwards.target(spans, bool(decode), rows)[0]

    def on_draft(self, wire: Wire, n: int) -> None:
        source, rows, spans = unpack(wire.recv(n))
        if source == SRC_WIRE:
            self.forwards.draft_step(spans, self._recv_hidden(wire, spans))
            return
        if self._target_hidden is None:
            raise RuntimeError("spec draft over target rows: expected a target forward first")
        self.forwards.draft_from_target(spans, self._target_hidden, rows)

    def _recv_hidden(self, wire: Wire, spans: list[SeqSpan]) -> torch.Tensor:
        """The chain step's input hidden states [T, H] that rank 0 broadcast."""
        tokens = sum(len(s.token_ids) for s in spans)
        width = self.runner.model_cfg.hidden_size
        flat = wire.recv_device(tokens * width, self.runner.dtype)
        return flat.view(tokens, width).to(self.runner.device)
