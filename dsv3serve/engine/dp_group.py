"""DP attention over a group: every rank runs its own DP rank's batch, in lockstep.

Rank 0 (the leader) holds the :class:`DPScheduler` (one scheduler per DP rank) and the
sampler. Each step it broadcasts every rank's spans; each rank forwards its own spans over
its own KV pool (a rank with none runs the model's idle step, so the MoE dispatch / combine
and the ``lm_head`` collectives stay in step), computes the logits of its sampled rows, and
the rows of all ranks are gathered to the leader alone, in rank order, which samples them all.

PD imports land on rank 0's pool (the KV connector's) in staging pages when the owning
rank is another one, and :meth:`DPGroupLeader.replicate_pages` moves them to the owner
point to point; no other rank receives them.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from dsv3serve.engine.dp_scheduler import DPScheduler
from dsv3serve.engine.group import (
    OP_DIGEST,
    OP_STOP,
    Wire,
    comm_device,
    encode_spans,
    gather_digest,
)
from dsv3serve.engine.group import decode_spans as decode_one
from dsv3serve.engine.model_runner import ModelRunner, StepResult
from dsv3serve.engine.sequence import ScheduledItem
from dsv3serve.forward_batch import SeqSpan

OP_DP_STEP, OP_DP_MOVE_PAGES = 17, 18


def encode_parts(parts: list[list[SeqSpan]]) -> torch.Tensor:
    """Every rank's spans as one int64 tensor: ``[ranks, len_0 .. len_{n-1}]`` + blobs."""
    blobs = [encode_spans(spans) for spans in parts]
    head = torch.tensor([len(parts), *(b.numel() for b in blobs)], dtype=torch.int64)
    return torch.cat([head, *blobs])


def decode_part(data: torch.Tensor, rank: int) -> list[SeqSpan]:
    """Rank ``rank``'s spans out of :func:`encode_parts`'s tensor."""
    ranks = int(data[0])
    sizes = data[1 : 1 + ranks].tolist()
    start = 1 + ranks + sum(sizes[:rank])
    return decode_one(data[start : start + sizes[rank]])


def forward_local(runner: ModelRunner, spans: list[SeqSpan]) -> torch.Tensor:
    """This rank's step: logits [rows, V] of its sampled rows (an idle step when empty)."""
    if spans:
        return runner.run_spans(spans, None).logits
    model = runner.model
    model.forward_idle()
    empty = torch.empty(0, model.cfg.hidden_size, dtype=runner.dtype, device=runner.device)
    return model.compute_logits(empty)


def gather_rows(rows: torch.Tensor, device: torch.device) -> torch.Tensor | None:
    """Every rank's ``rows`` [n_r, V] concatenated in rank order, on rank 0 only (None on
    the others: they never need the other ranks' logits). One host sync for the counts."""
    world, leader = dist.get_world_size(), dist.get_rank() == 0
    count = torch.tensor([rows.shape[0]], dtype=torch.int64, device=device)
    counts = [torch.empty_like(count) for _ in range(world)]
    dist.all_gather(counts, count)
    sizes = [int(c) for c in counts]
    padded = rows.new_zeros((max(sizes), *rows.shape[1:])).to(device)
    padded[: rows.shape[0]] = rows.to(device)
    parts = [torch.empty_like(padded) for _ in range(world)] if leader else None
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


class DPGroupLeader:
    """Rank 0's runner under DP attention; see the module docstring."""

    def __init__(self, runner: ModelRunner, scheduler: DPScheduler) -> None:
        self.runner, self.scheduler = runner, scheduler
        self.world_size = scheduler.dp_size
        self._wire = Wire(comm_device(runner))

    def __getattr__(self, name: str) -> object:  # pool, device, dtype, num_pages, ...
        return getattr(self.runner, name)

    def run(self, items: list[ScheduledItem]) -> StepResult:
        """Forward every rank's items; logits of all sampled rows, rank by rank."""
        parts: list[list[ScheduledItem]] = [[] for _ in range(self.world_size)]
        for item in items:
            parts[item.seq.dp_rank].append(item)
        spans = [self.runner.spans(part) for part in parts]
        self._wire.send(OP_DP_STEP, encode_parts(spans))
        logits = gather_rows(forward_local(self.runner, spans[0]), self._wire.device)
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
        self._wire.send(OP_DP_MOVE_PAGES, torch.tensor([rank, *local], dtype=torch.int64))
        send_pages(self.runner, staging, rank)
        self.scheduler.ranks[0].release_reservation(staging)

    def digests(self) -> list[torch.Tensor]:
        """Every rank's pool fingerprint (the pools differ under DP attention)."""
        self._wire.send(OP_DIGEST)
        return gather_digest(self.runner, self.world_size)

    def stop(self) -> None:
        """End the other ranks' loops."""
        self._wire.send(OP_STOP)


def dp_follower_loop(runner: ModelRunner) -> int:
    """Ranks 1..N-1 under DP attention: run their part of each step until STOP."""
    wire, rank = Wire(comm_device(runner)), dist.get_rank()
    steps = 0
    while True:
        op, n = wire.recv_header()
        if op == OP_DP_STEP:
            spans = decode_part(wire.recv(n).cpu(), rank)
            gather_rows(forward_local(runner, spans), wire.device)
            steps += 1
        elif op == OP_DP_MOVE_PAGES:
            owner, *pages = wire.recv(n).tolist()
            if owner == rank:
                recv_pages(runner, pages, src=0)
        elif op == OP_DIGEST:
            gather_digest(runner, dist.get_world_size())
        elif op == OP_STOP:
            return steps
        else:
            raise RuntimeError(f"unknown DP group op {op}")
