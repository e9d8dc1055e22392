"""One engine over N ranks: rank 0 schedules, every rank runs the same forward in lockstep.

Rank 0 (the leader) owns the scheduler. Each step it broadcasts the step's spans over
``torch.distributed`` and every rank runs the forward on its
own device and KV pool. KV pages that arrive from outside (PD import) are broadcast from
rank 0 to the other ranks' pools the same way, so every pool holds the same pages.

Each rank holds its shard of the model (:mod:`dsv3serve.engine.group.rank_parts`). Only tensors
and fixed-layout int64 headers cross the wire (no pickle). A rank that dies makes rank 0's
next collective raise (connection closed, or the group timeout): the engine's step fails.

The commands (headers, spans) travel on a second, gloo group of the same ranks
(:func:`control_group`), and only device tensors on the default group (NCCL on GPUs). A
command sent over NCCL cost a host sync on both sides: rank 0 copied it to the device from
pageable memory (which waits for every queued kernel) and a follower read it back (which
waits for its own queue), so neither host could prepare step n+1 while step n ran
(measured on two H200s, 2026-11-29: docs/perf/group_step.md).
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from dsv3serve.engine.eplb_runtime import EplbRuntime
from dsv3serve.engine.model_runner import ModelRunner, StepResult
from dsv3serve.engine.scheduler.sequence import ScheduledItem
from dsv3serve.forward_batch import SeqSpan
from dsv3serve.kvcache.pool import MLAKVPool

OP_STEP, OP_WRITE_PAGES, OP_DIGEST, OP_STOP, OP_SAMPLED = 1, 2, 3, 4, 5
_HEADER_LEN = 2  # [op, payload length]
_SPAN_HEADER_LEN = 5  # [n_tokens, start, sample, page_size (0: slot list), n_entries]


# A follower waits this long for rank 0's next command: an idle group is normal, and a
# follower shares its leader's fate (it dies with it), so only the leader's waits are short.
FOLLOWER_WAIT_S = 7 * 24 * 3600.0
# ProcessGroupNCCL: a collective past the group's timeout raises in the waiting thread
# (blocking wait) and aborts only the communicator, so the engine can fail its requests
# cleanly instead of the watchdog tearing the process down.
NCCL_FAULT_ENV = {"TORCH_NCCL_BLOCKING_WAIT": "1", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "2"}


@dataclass(frozen=True)
class GroupSpec:
    """Where rank ``rank`` of a ``world_size``-rank group meets the others.

    ``timeout_s`` bounds every collective of this rank (the join included): rank 0's
    (the leader's) is the group timeout, after which a step blocked on a dead or hung rank
    raises; followers use :data:`FOLLOWER_WAIT_S` since they wait for rank 0 while idle.
    """

    rank: int
    world_size: int
    master_addr: str
    master_port: int
    backend: str  # "gloo" or "nccl"
    timeout_s: float = 600.0
    init_method: str | None = None  # default: tcp://master_addr:master_port


def rank_timeout_s(rank: int, group_timeout_s: float) -> float:
    """The collective timeout of ``rank``: the group's on rank 0, :data:`FOLLOWER_WAIT_S`
    on the others."""
    return group_timeout_s if rank == 0 else FOLLOWER_WAIT_S


_control: dist.ProcessGroup | None = None


def init_group(spec: GroupSpec) -> None:
    """Join the group's default process group (blocks until every rank has joined), then
    its gloo control group (:func:`control_group`), whatever the default's backend."""
    global _control
    if spec.backend == "nccl":
        for name, value in NCCL_FAULT_ENV.items():
            os.environ.setdefault(name, value)
    timeout = datetime.timedelta(seconds=spec.timeout_s)
    dist.init_process_group(
        spec.backend,
        init_method=spec.init_method or f"tcp://{spec.master_addr}:{spec.master_port}",
        world_size=spec.world_size,
        rank=spec.rank,
        timeout=timeout,
    )
    # on gloo too, so the CPU tests run the same two-group order as NCCL ranks do
    _control = dist.new_group(backend="gloo", timeout=timeout)


def control_group() -> dist.ProcessGroup | None:
    """The group rank 0's commands travel on: host tensors over gloo, beside the default
    group (NCCL on GPUs), so sending or reading one never waits for a device queue. None
    before :func:`init_group` (the default group is used)."""
    return _control


def encode_spans(spans: Sequence[SeqSpan]) -> torch.Tensor:
    """Spans as one int64 tensor: ``[count]``, then per span ``[n_tokens, start, sample,
    page_size, n_entries]`` + token ids + entries: its page table when ``page_size > 0``
    (only the pages it uses), else its slot list."""
    flat: list[int] = [len(spans)]
    for s in spans:
        entries = s.kv_slots if s.page_table is None else s.page_table
        flat += [len(s.token_ids), s.start, int(s.sample), s.page_size, len(entries)]
        flat += s.token_ids
        flat += entries
    return torch.tensor(flat, dtype=torch.int64)


def decode_spans(data: torch.Tensor) -> list[SeqSpan]:
    """Inverse of :func:`encode_spans`."""
    flat = data.tolist()
    spans, i = [], 1
    for _ in range(flat[0]):
        n_tok, start, sample, page_size, n_entries = flat[i : i + _SPAN_HEADER_LEN]
        i += _SPAN_HEADER_LEN
        tokens = flat[i : i + n_tok]
        i += n_tok
        entries = flat[i : i + n_entries]
        i += n_entries
        if page_size > 0:
            spans.append(
                SeqSpan(tokens, start, None, bool(sample), page_table=entries, page_size=page_size)
            )
        else:
            spans.append(SeqSpan(tokens, start, entries, bool(sample)))
    return spans


def pool_digest(pool: MLAKVPool) -> torch.Tensor:
    """A float64 fingerprint of every layer's raw storage (and fp8 scales): [layers]."""
    sums = []
    for layer in range(pool.num_layers):
        raw = pool.kv_buffer(layer).view(torch.uint8).to(torch.float64)
        weights = torch.arange(raw.numel(), device=raw.device, dtype=torch.float64) % 251 + 1
        total = (raw.flatten() * weights).sum()
        scale = pool.scale_buffer(layer)
        if scale is not None:
            total = total + scale.to(torch.float64).sum()
        sums.append(total)
    return torch.stack(sums)


class Wire:
    """Rank 0's commands to the other ranks: an int64 header ``[op, payload length]`` and an
    int64 host payload, broadcast on the control group (:func:`control_group`, host memory:
    no device sync on either side), and device tensors broadcast on the default group from
    ``device`` (the group's communication device: :func:`comm_device`)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.control = control_group()

    def send(self, op: int, payload: torch.Tensor | None = None) -> None:
        """Rank 0: command ``op`` with host int64 ``payload``."""
        n = 0 if payload is None else payload.numel()
        dist.broadcast(torch.tensor([op, n], dtype=torch.int64), src=0, group=self.control)
        if payload is not None and n:
            dist.broadcast(payload.to("cpu", torch.int64), src=0, group=self.control)

    def recv_header(self) -> tuple[int, int]:
        """The other ranks: the next command's op and payload length."""
        header = torch.empty(_HEADER_LEN, dtype=torch.int64)
        dist.broadcast(header, src=0, group=self.control)
        op, n = header.tolist()
        return op, n

    def recv(self, n: int) -> torch.Tensor:
        """The other ranks: the command's host payload (int64, ``n`` values)."""
        payload = torch.empty(n, dtype=torch.int64)
        dist.broadcast(payload, src=0, group=self.control)
        return payload

    def send_device(self, data: torch.Tensor) -> None:
        """Rank 0: a device tensor to every rank (queued on the device, no host sync)."""
        dist.broadcast(data.to(self.device).contiguous(), src=0)

    def recv_device(self, n: int, dtype: torch.dtype) -> torch.Tensor:
        """The other ranks: :meth:`send_device`'s ``n`` values of ``dtype``, on ``device``."""
        data = torch.empty(n, dtype=dtype, device=self.device)
        dist.broadcast(data, src=0)
        return data


def comm_device(runner: ModelRunner) -> torch.device:
    return runner.device if dist.get_backend() == "nccl" else torch.device("cpu")


def broadcast_pages(runner: ModelRunner, pages: torch.Tensor, wire: Wire, send: bool) -> None:
    """Rank 0 sends the raw storage of ``pages`` of every layer; the others write it."""
    pool = runner.pool
    idx = pages.to(pool.device)
    for layer in range(pool.num_layers):
        buffers = [pool.kv_buffer(layer)]
        scale = pool.scale_buffer(layer)
        if scale is not None:
            buffers.append(scale)
        for buf in buffers:
            rows = buf[idx].contiguous()
            raw = rows.view(torch.uint8).to(wire.device)
            dist.broadcast(raw, src=0)
            if not send:
                buf[idx] = raw.to(pool.device).view(buf.dtype).view(rows.shape)


class LeaderBase:
    """What every group's rank 0 runner shares: the wire to the other ranks, the rank's
    own :class:`ModelRunner` (whose attributes it passes through), the overlap ring's
    sampled ids, pool digests and the group's stop."""

    def __init__(self, runner: ModelRunner, world_size: int) -> None:
        self.runner = runner
        self.world_size = world_size
        self._wire = Wire(comm_device(runner))

    def __getattr__(self, name: str) -> object:  # num_pages, graphs, read_pages, ...
        return getattr(self.runner, name)

    @property
    def device(self) -> torch.device:
        return self.runner.device

    @property
    def dtype(self) -> torch.dtype:
        return self.runner.dtype

    @property
    def pool(self) -> MLAKVPool:
        return self.runner.pool

    @property
    def eplb(self) -> EplbRuntime | None:
        return self.runner.eplb

    def share_sampled(self, start: int, token_ids: torch.Tensor) -> None:
        """Overlap scheduling: the step's sampled ids, for every rank's ring."""
        send_sampled(self._wire, start, token_ids)

    def digests(self) -> list[torch.Tensor]:
        """Every rank's pool fingerprint (rank order)."""
        self._wire.send(OP_DIGEST)
        return gather_digest(self.runner, self.world_size)

    def stop(self) -> None:
        """End the other ranks' loops; every rank then releases its collective resources
        (:meth:`ModelRunner.close`) at the same point."""
        self._wire.send(OP_STOP)
        self.runner.close()


class GroupLeader(LeaderBase):
    """Rank 0's runner: broadcasts each step, then runs it like a plain ModelRunner."""

    def run(self, items: list[ScheduledItem]) -> StepResult:
        """Broadcast the step's spans, then forward them here."""
        batch_spans = self.runner.spans(items)
        self._wire.send(OP_STEP, encode_spans(batch_spans))
        return self.runner.run_spans(batch_spans, items)

    def write_pages(self, pages: list[int], kv: torch.Tensor) -> None:
        """Write pages here (compute dtype) and replicate their raw storage to every rank."""
        self.runner.write_pages(pages, kv)
        self.replicate_pages(pages)

    def replicate_pages(self, pages: list[int]) -> None:
        """Copy the raw storage of ``pages`` from this pool to every other rank's pool."""
        idx = torch.tensor(pages, dtype=torch.int64)
        self._wire.send(OP_WRITE_PAGES, idx)
        broadcast_pages(self.runner, idx, self._wire, send=True)


def send_sampled(wire: Wire, start: int, token_ids: torch.Tensor) -> None:
    """Overlap scheduling: rank 0 just wrote ``token_ids`` [n] into its future-token ring at
    ``start``; every rank writes them into its own ring, where its next step's placeholders
    resolve. ``start`` and ``n`` travel as the command, the ids on the device: no host sync
    on any rank."""
    wire.send(OP_SAMPLED, torch.tensor([start, token_ids.numel()], dtype=torch.int64))
    wire.send_device(token_ids.to(torch.int64))


def store_sampled(runner: ModelRunner, wire: Wire, n: int) -> None:
    """A follower's side of :func:`send_sampled`."""
    start, count = wire.recv(n).tolist()
    ids = wire.recv_device(count, torch.int64)
    if runner.future is None:
        raise RuntimeError("sampled ids for the overlap ring: expected overlap on every rank")
    runner.future.store(start, ids.to(runner.future.buffer.device))


def gather_digest(runner: ModelRunner, world_size: int) -> list[torch.Tensor]:
    mine = pool_digest(runner.pool).to(comm_device(runner))
    out = [torch.empty_like(mine) for _ in range(world_size)]
    dist.all_gather(out, mine)
    return [t.cpu() for t in out]


OpHandler = Callable[["Wire", int], None]  # called with the wire and the payload length


def serve_ops(runner: ModelRunner, wire: Wire, ops: Mapping[int, OpHandler], group: str) -> None:
    """A follower's loop: run rank 0's commands until STOP, by ``ops`` and the ones every
    group shares (the overlap ring's sampled ids, pool digests); an unknown op raises."""

    def digest(wire: Wire, n: int) -> None:
        gather_digest(runner, dist.get_world_size())

    handlers = {**ops, OP_SAMPLED: lambda w, n: store_sampled(runner, w, n), OP_DIGEST: digest}
    while True:
        op, n = wire.recv_header()
        if op == OP_STOP:
            return
        handler = handlers.get(op)
        if handler is None:
            raise RuntimeError(f"unknown {group} op {op}")
        handler(wire, n)


def follower_loop(runner: ModelRunner, extra: Mapping[int, OpHandler] | None = None) -> int:
    """Ranks 1..N-1: execute rank 0's commands until STOP; returns the plain steps run.

    ``extra`` maps more ops to handlers called with the wire and the payload length
    (speculative decoding's forwards: :mod:`dsv3serve.engine.speculative.group`).
    """
    steps = 0

    def step(wire: Wire, n: int) -> None:
        nonlocal steps
        runner.run_spans(decode_spans(wire.recv(n)), None)
        steps += 1

    def write_pages(wire: Wire, n: int) -> None:
        broadcast_pages(runner, wire.recv(n), wire, send=False)

    ops = {**(extra or {}), OP_STEP: step, OP_WRITE_PAGES: write_pages}
    serve_ops(runner, Wire(comm_device(runner)), ops, "group")
    return steps
