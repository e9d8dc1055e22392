"""DP attention over a group: every rank runs its own DP rank's batch, in lockstep.

Rank 0 (the leader) holds the :class:`DPScheduler` (one scheduler per DP rank) and the
sampler. Each step it broadcasts every rank's spans; each rank forwards its own spans over
its own KV pool (a rank with none runs the model's idle step, so the MoE dispatch / combine
and the ``lm_head`` collectives stay in step), computes the logits of its sampled rows, and
the rows of all ranks are gathered to the leader alone, in rank order, which samples them all.

The step header also carries what the ranks must agree on (:class:`StepShape`): whether
it is a decode step, and the CUDA-graph size every rank replays when each rank's batch is a
decode batch that a captured graph holds (a rank with fewer sequences pads with dummies,
one with none replays dummies only), so the graphs' collectives match.

PD imports land on rank 0's pool (the KV connector's) in staging pages when the owning
rank is another one, and :meth:`DPGroupLeader.replicate_pages` moves them to the owner
point to point; no other rank receives them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from dsv3serve.engine.cuda_graph import DecodeGraphs, graphable
from dsv3serve.engine.graph_capture import padded_size
from dsv3serve.engine.group.tp import (
    LeaderBase,
    OpHandler,
    Wire,
    comm_device,
    encode_spans,
    serve_ops,
)
from dsv3serve.engine.group.tp import decode_spans as decode_one
from dsv3serve.engine.model_runner import ModelRunner, StepResult
from dsv3serve.engine.scheduler.dp import DPScheduler
from dsv3serve.engine.scheduler.sequence import ScheduledItem
from dsv3serve.forward_batch import SeqSpan

OP_DP_STEP, OP_DP_MOVE_PAGES = 17, 18


def sampled_rows(parts: list[list[SeqSpan]]) -> list[int]:
    """How many logits rows each rank's spans yield (its spans with ``sample``)."""
    return [sum(span.sample for span in spans) for spans in parts]


@dataclass(frozen=True)
class StepShape:
    """What every rank must agree on before a DP step's forward: the CUDA-graph size all
    ranks replay (0: eager), and whether it is a decode step (one sampled token per span on
    every rank; a masked dispatcher picks its mode by it), and the most tokens any rank
    forwards (a masked dispatcher sends a larger batch in that many rounds of its bound)."""

    graph_size: int = 0
    decode: bool = False
    max_tokens: int = 0


def step_shape(parts: list[list[SeqSpan]], graphs: DecodeGraphs | None) -> StepShape:
    """The leader's choice for ``parts`` (every rank's spans): a graph when every rank's
    batch is a decode batch (or empty) that the largest captured size holds."""
    most = max(len(part) for part in parts)
    tokens = max(sum(len(span.token_ids) for span in part) for part in parts)
    decode = most > 0 and all(graphable(part, most) for part in parts if part)
    if graphs is None or not decode or most > graphs.max_batch_size:
        return StepShape(0, decode, tokens)
    return StepShape(padded_size(graphs.sizes, most), decode, tokens)


_HEAD = 4  # [ranks, graph_size, decode, max_tokens]


def encode_parts(parts: list[list[SeqSpan]], shape: StepShape = StepShape()) -> torch.Tensor:
    """Every rank's spans as one int64 tensor: ``[ranks, graph_size, decode, max_tokens, len_0 ..
    len_{n-1}, rows_0 .. rows_{n-1}]`` + blobs (``rows_r``: rank r's sampled rows, so no
    rank asks for them)."""
    blobs = [encode_spans(spans) for spans in parts]
    sizes = [b.numel() for b in blobs]
    head = [len(parts), shape.graph_size, int(shape.decode), shape.max_tokens, *sizes]
    head += sampled_rows(parts)
    return torch.cat([torch.tensor(head, dtype=torch.int64), *blobs])


def decode_part(data: torch.Tensor, rank: int) -> tuple[list[SeqSpan], list[int], StepShape]:
    """Rank ``rank``'s spans out of :func:`encode_parts`'s tensor, every rank's rows and
    the step's shape."""
    ranks, graph_size, decode, max_tokens = data[:_HEAD].tolist()
    head = data[_HEAD : _HEAD + 2 * ranks].tolist()
    sizes, rows = head[:ranks], head[ranks:]
    start = _HEAD + 2 * ranks + sum(sizes[:rank])
    spans = decode_one(data[start : start + sizes[rank]])
    return spans, rows, StepShape(graph_size, bool(decode), max_tokens)


def idle_logits(runner: ModelRunner) -> torch.Tensor:
    """Logits [0, V] of no rows: joins a vocab-parallel head's collective with nothing."""
    model = runner.model
    empty = torch.empty(0, model.cfg.hidden_size, dtype=runner.dtype, device=runner.device)
    return model.compute_logits(empty)


def forward_local(
    runner: ModelRunner, spans: list[SeqSpan], shape: StepShape = StepShape()
) -> torch.Tensor:
    """This rank's step: logits [rows, V] of its sampled rows (an idle step when empty, or
    dummy rows of the agreed graph size)."""
    runner.set_step_phase(shape.decode, shape.max_tokens)
    try:
        if shape.graph_size:
            if runner.graphs is None:
                raise RuntimeError("the leader chose a CUDA graph; this rank captured none")
            runner.prepare_graph()
            return runner.graphs.run_padded(spans, shape.graph_size)
        if spans:
            return runner.run_spans(spans, None).logits
        runner.model.forward_idle()
        return idle_logits(runner)
    finally:  # other forwards (speculative ones) set no phase: never leave decode on
        runner.set_step_phase(False)
        if runner.eplb is not None:  # between steps, on every rank at the same step
            runner.eplb.tick(runner.model)


def gather_rows(rows: torch.Tensor, sizes: list[int], device: torch.device) -> Tensor | None:
    """Every rank's ``rows`` [sizes[r], V] concatenated in rank order, on rank 0 only (None on
    the others: they never need the other ranks' logits). The sizes travel with the step, so
    no rank waits on the host for them."""
    leader = dist.get_rank() == 0
    padded = rows.new_empty((max(sizes), *rows.shape[1:]), device=device)
    padded[: rows.shape[0]] = rows
    parts = [torch.empty_like(padded) for _ in sizes] if leader else None
    dist.gather(padded, parts, dst=0)
    if parts is None:
        return None
    return torch.cat([p[:n] for p, n in zip(parts, sizes, strict=True)])


def _page_buffers(runner: ModelRunner) -> list[torch.Tensor]:
    pool = runner.pool
    out = [pool.kv_buffer(layer) for layer in range(pool.num_layers)]
    scales = [pool.scale_buffer(layer) for layer in range(pool.num_layers)]
    return out + [s for s in scales if s is not None]


def send_pages(runner: ModelRunner, pages: list[int], dst: int) -> None:
    """Send the raw storage of ``pages`` (every layer, fp8 scales too) to rank ``dst``."""
    idx = torch.tensor(pages, dtype=torch.int64, device=runner.pool.device)
    device = comm_device(runner)
    for buf in _page_buffers(runner):
        dist.send(buf[idx].contiguous().view(torch.uint8).to(device), dst)


def recv_pages(runner: ModelRunner, pages: list[int], src: int) -> None:
    """Write the raw storage :func:`send_pages` sends into ``pages`` of this pool."""
    idx = torch.tensor(pages, dtype=torch.int64, device=runner.pool.device)
    device = comm_device(runner)
    for buf in _page_buffers(runner):
        rows = buf[idx]
        raw = torch.empty(rows.view(torch.uint8).shape, dtype=torch.uint8, device=device)
        dist.recv(raw, src)
        buf[idx] = raw.to(buf.device).view(buf.dtype).view(rows.shape)


class DPGroupLeader(LeaderBase):
    """Rank 0's runner under DP attention; see the module docstring. Its pool digests
    differ rank by rank (each DP rank holds its own pool)."""

    def __init__(self, runner: ModelRunner, scheduler: DPScheduler) -> None:
        super().__init__(runner, scheduler.dp_size)
        self.scheduler = scheduler

    def run(self, items: list[ScheduledItem]) -> StepResult:
        """Forward every rank's items; logits of all sampled rows, rank by rank."""
        parts: list[list[ScheduledItem]] = [[] for _ in range(self.world_size)]
        for item in items:
            parts[item.seq.dp_rank].append(item)
        spans = [self.runner.spans(part) for part in parts]
        shape = step_shape(spans, self.runner.graphs)
        self._wire.send(OP_DP_STEP, encode_parts(spans, shape))
        rows = forward_local(self.runner, spans[0], shape)
        logits = gather_rows(rows, sampled_rows(spans), self._wire.device)
        assert logits is not None  # rank 0 receives every rank's rows
        sampled = [item for part in parts for item in part if item.sample]
        return StepResult(logits.to(self.runner.device), sampled)

    def landing_pages(self, pages: list[int]) -> list[int]:
        """Rank 0's pages a KV connector writes a reservation's KV into."""
        return self.scheduler.landing_pages(pages)

    def replicate_pages(self, pages: list[int]) -> None:
        """After an import landed: move it from rank 0's staging pages to its owner."""
        rank, local = self.scheduler.split_pages(pages)
        if rank == 0:
            return
        staging = self.scheduler.take_staging(pages)
        try:
            self._wire.send(OP_DP_MOVE_PAGES, torch.tensor([rank, *local], dtype=torch.int64))
            send_pages(self.runner, staging, rank)
        finally:  # moved or not, the staging pages go back
            self.scheduler.ranks[0].release_reservation(staging)


def dp_follower_loop(runner: ModelRunner, extra: Mapping[int, OpHandler] | None = None) -> int:
    """Ranks 1..N-1 under DP attention: run their part of each step until STOP.

    ``extra`` maps more ops to handlers called with the wire and the payload length
    (speculative decoding's forwards: :mod:`dsv3serve.engine.speculative.dp_group`).
    """
    rank, steps = dist.get_rank(), 0

    def step(wire: Wire, n: int) -> None:
        nonlocal steps
        spans, sizes, shape = decode_part(wire.recv(n), rank)
        gather_rows(forward_local(runner, spans, shape), sizes, wire.device)
        steps += 1

    def move_pages(wire: Wire, n: int) -> None:
        owner, *pages = wire.recv(n).tolist()
        if owner == rank:
            recv_pages(runner, pages, src=0)

    ops = {**(extra or {}), OP_DP_STEP: step, OP_DP_MOVE_PAGES: move_pages}
    serve_ops(runner, Wire(comm_device(runner)), ops, "DP group")
    return steps
