"""What every CUDA-graph runner of the engine shares: padding, static inputs and capture.

A runner pads a batch of ``b`` sequences to a captured size ``B >= b`` with dummy spans
on scratch pages the allocator never hands out, copies the padded batch's token ids,
positions and output slots into static buffers (:class:`StaticInputs`), plans attention
on the host, then replays the graph captured for ``B`` (:class:`GraphCache`). Without a
capture (CPU, tests, a size not captured) the same forward runs eagerly on the same
static buffers, so the padding path is testable anywhere.

A capture first runs its forward twice uncaptured (:func:`warm_up`); those forwards are
not traffic, so the MoE dispatch meters do not record them.

Several layouts planned at once (the chained draft steps of a round, or verify beside
decode) each plan on their own attention *fork* (:func:`fork_attention`): a shallow copy
of the backend that keeps its own planned batch, and with flashinfer its own CUDA-graph
wrappers (``graph_slot``), so one plan does not overwrite another's buffers.
"""

from __future__ import annotations

import copy
import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import ClassVar, Generic, TypeVar

import torch

from dsv3serve.attention.base import AttentionBackend
from dsv3serve.engine.static_inputs import StaticInputs
from dsv3serve.forward_batch import ForwardBatch, SeqSpan
from dsv3serve.parallel.dispatch_meter import unmetered

logger = logging.getLogger(__name__)

T = TypeVar("T")

# what torch.cuda.graph_pool_handle() returns: the memory pool graphs of one rank share
GraphPool = torch.cuda._POOL_HANDLE  # torch's opaque id of a graph memory pool


@dataclass(frozen=True)
class GraphSetup:
    """What a graph runner is built with: the attention backend it plans on, the batch
    sizes it captures, the scratch slots padding sequences write to (page-aligned from
    row 0 of a scratch page the allocator never hands out), whether to capture
    (``False``: the padded static-buffer path runs eagerly, as on CPU) and the CUDA graph
    memory pool to share (one of its own when None)."""

    attn: AttentionBackend
    sizes: list[int]
    scratch_slots: list[int]
    capture: bool = True
    mempool: GraphPool | None = None


def padded_size(sizes: list[int], num_seqs: int) -> int:
    """The smallest of the sorted ``sizes`` that holds ``num_seqs`` sequences."""
    for size in sizes:
        if size >= num_seqs:
            return size
    raise ValueError(f"expected at most {sizes[-1]} sequences for a graph, got {num_seqs}")


def pad_spans(spans: list[SeqSpan], size: int, dummy: SeqSpan) -> list[SeqSpan]:
    """``spans`` followed by ``size - len(spans)`` copies of ``dummy``."""
    return spans + [dummy] * (size - len(spans))


def plan_for_graph(attn: AttentionBackend, batch: ForwardBatch) -> None:
    """``attn.plan(batch)`` for a captured graph, which bakes in page-granular KV addressing:
    a plan that fell back to one slot per page would make the replay read wrong rows."""
    attn.plan(batch)
    pool = getattr(attn, "pool", None)
    if getattr(attn, "index_mode", "page") == "token" and pool is not None and pool.page_size > 1:
        raise RuntimeError(
            "CUDA-graph batch planned with token-granular KV indices (slots not page-aligned); "
            f"expected page-granular indices for page_size {pool.page_size}"
        )


def fork_attention(attn: AttentionBackend, slot: str) -> AttentionBackend:
    """A shallow copy of ``attn`` holding its own plan; with a backend that has CUDA-graph
    wrappers (``graph_slot``), planning into wrappers of its own ``slot``."""
    fork = copy.copy(attn)
    if hasattr(fork, "graph_slot"):
        fork.graph_slot = slot
    return fork


def warm_up(forward: Callable[[], object], runs: int = 2) -> None:
    """Run ``forward`` ``runs`` times before its capture (compiles, first-call set-up), on
    the current stream. Not traffic: no dispatch meter records these forwards."""
    with unmetered():
        for _ in range(runs):
            forward()


class GraphCache(Generic[T]):
    """CUDA graphs by batch size over caller-owned static buffers, in one memory pool.

    ``forward`` callables read only static buffers and planned attention; what they
    return (tensors, or tuples of them) is the graph's static output, overwritten by the
    next replay of any graph sharing the pool: callers copy what they keep.
    """

    def __init__(self, device: torch.device, mempool: GraphPool | None = None) -> None:
        self.device = device
        self._mempool = mempool
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._outputs: dict[int, T] = {}
        self.replays = 0  # forwards served by a graph
        self.capture_s = 0.0  # seconds spent in capture() (warm-up compiles included)

    def capture(self, size: int, forward: Callable[[], T]) -> None:
        """Warm ``forward`` up on a side stream (compiles, first-call set-up), then capture;
        logs the seconds it took (a cold start's JIT compiles land in the first one)."""
        start = time.perf_counter()
        self._capture(size, forward)
        torch.cuda.synchronize(self.device)
        took = time.perf_counter() - start
        self.capture_s += took
        logger.info(
            "CUDA graph of batch size %d captured in %.2f s (%.2f s in this cache)",
            size, took, self.capture_s,
        )  # fmt: skip

    def _capture(self, size: int, forward: Callable[[], T]) -> None:
        if self._mempool is None:
            self._mempool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            warm_up(forward)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._mempool):
            self._outputs[size] = forward()
        self._graphs[size] = graph

    def release(self) -> None:
        """Free every captured graph (later runs are eager). A group releases its graphs
        before it leaves its process group: graphs that captured NCCL collectives still hold
        the communicator, and on two H100s ``destroy_process_group`` hung on every rank
        while they lived."""
        if self._graphs and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        for graph in self._graphs.values():
            graph.reset()
        self._graphs.clear()
        self._outputs.clear()

    def run(self, size: int, forward: Callable[[], T]) -> T:
        """Replay the graph of ``size`` (its static outputs), or run ``forward`` eagerly."""
        graph = self._graphs.get(size)
        if graph is None:
            return forward()
        graph.replay()
        self.replays += 1
        return self._outputs[size]


class SpanGraphs(ABC, Generic[T]):
    """A captured decode-form forward over ``width`` tokens per sequence, by batch size.

    The shared half of the speculative graphs (verify, draft extend): batches are padded
    with :attr:`dummy` (``width`` tokens on scratch slots) to a captured size, loaded into
    one :class:`StaticInputs` and planned on the runner's own attention fork. A subclass
    gives :meth:`_forward` (what one graph computes), and calls :meth:`_capture_all` once
    its own buffers exist.
    """

    kind: ClassVar[str]  # the attention fork's slot and the name in errors
    label: ClassVar[str]  # the name in the capture log

    def __init__(self, setup: GraphSetup, device: torch.device, width: int, sample: bool) -> None:
        """``setup.scratch_slots``: at least ``width`` slots for the padding sequences;
        ``sample``: whether the padding wants logits."""
        scratch_slots = setup.scratch_slots
        if len(scratch_slots) < width:
            raise ValueError(
                f"{self.kind} graphs pad with {width} tokens per sequence, expected as many "
                f"scratch slots, got {len(scratch_slots)}"
            )
        self.width, self.sizes, self.device = width, sorted(setup.sizes), device
        self.dummy = SeqSpan([0] * width, 0, scratch_slots[:width], sample)
        self._attn = fork_attention(setup.attn, self.kind)
        self._inputs = StaticInputs(self.sizes[-1] * width, scratch_slots[0], device)
        self._graphs: GraphCache[T] = GraphCache(device, setup.mempool)
        self.runs = 0  # forwards through the padded path (replayed or not)

    @property
    def replays(self) -> int:
        """Forwards served by a graph."""
        return self._graphs.replays

    @abstractmethod
    def _forward(self, batch: ForwardBatch) -> T:
        """What one graph computes over the loaded static ``batch``."""

    def release(self) -> None:
        """Free the captured graphs (later forwards run the same padded path eagerly)."""
        self._graphs.release()

    def _capture_all(self, load: Callable[[int], ForwardBatch]) -> None:
        """Capture every size, largest first (later graphs reuse its memory)."""
        for size in reversed(self.sizes):
            batch = load(size)
            self._graphs.capture(size, partial(self._forward, batch))
        logger.info("captured %s CUDA graphs for batch sizes %s", self.label, self.sizes)

    def _load_spans(self, spans: list[SeqSpan], size: int) -> ForwardBatch:
        """Pad ``spans`` to ``size``, copy them into the static inputs and plan."""
        padded = pad_spans(spans, size, self.dummy)
        static = self._inputs.build(padded)
        plan_for_graph(self._attn, static)
        return static

    def _replay(self, size: int, batch: ForwardBatch) -> T:
        """The graph of ``size`` over the loaded ``batch`` (eager where none was captured)."""
        out = self._graphs.run(size, lambda: self._forward(batch))
        self.runs += 1
        return out
