"""CUDA graphs for decode steps: one graph per captured batch size, replayed after planning.

A decode batch of ``b`` sequences runs on the smallest captured size ``B >= b``. The ``B - b``
padding rows are dummy sequences of one token over a scratch page that the allocator never
hands out, so their latent writes and attention reads touch nothing real. Per step, the host
builds the padded batch, copies its token ids, positions and output slots into the graph's
static buffers, plans attention (flashinfer's CUDA-graph wrappers keep fixed buffers, so the
captured kernels read the new plan), replays, and slices the first ``b`` logits rows.

Prefill, extend and multi-token (speculative verify) steps stay eager.
"""

from __future__ import annotations

import dataclasses
import logging

import torch

from dsv3serve.attention.base import AttentionBackend
from dsv3serve.forward_batch import ForwardBatch, SeqSpan
from dsv3serve.model.deepseek_v3 import DeepseekV3ForCausalLM

logger = logging.getLogger(__name__)


def capture_sizes(max_bs: int) -> list[int]:
    """Batch sizes to capture: 1, 2, 4, 8, then every 16 up to ``max_bs`` (always included)."""
    sizes = [s for s in (1, 2, 4, 8) if s <= max_bs] + list(range(16, max_bs + 1, 16))
    return sorted(set(sizes) | {max_bs})


def graphable(spans: list[SeqSpan], max_bs: int) -> bool:
    """A plain decode step: one new token per sequence, logits for each, within ``max_bs``."""
    return 0 < len(spans) <= max_bs and all(len(s.token_ids) == 1 and s.sample for s in spans)


class DecodeGraphs:
    """Captured decode forwards (model + LM head) of ``model`` for each of ``sizes``."""

    def __init__(
        self,
        model: DeepseekV3ForCausalLM,
        attn: AttentionBackend,
        device: torch.device,
        sizes: list[int],
        scratch_slot: int,
        capture: bool = True,
    ) -> None:
        """``capture=False`` keeps the padded static-buffer path but runs it eagerly (CPU
        tests of the padding, and a fallback)."""
        self.model, self.attn, self.device = model, attn, device
        self.sizes = sorted(sizes)
        self._dummy = SeqSpan([0], 0, [scratch_slot], True)
        n = self.sizes[-1]
        self._ids = torch.zeros(n, dtype=torch.int64, device=device)
        self._pos = torch.zeros(n, dtype=torch.int64, device=device)
        self._out = torch.full((n,), scratch_slot, dtype=torch.int64, device=device)
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._logits: dict[int, torch.Tensor] = {}
        self.replays = 0  # decode steps served by a graph
        if capture:
            self._mempool = torch.cuda.graph_pool_handle()
            for size in reversed(self.sizes):  # largest first: later graphs reuse its memory
                self._capture(size)
            logger.info("captured decode CUDA graphs for batch sizes %s", self.sizes)

    @property
    def max_batch_size(self) -> int:
        return self.sizes[-1]

    def can_run(self, spans: list[SeqSpan]) -> bool:
        return graphable(spans, self.max_batch_size)

    def _load(self, spans: list[SeqSpan], size: int) -> ForwardBatch:
        """Pad ``spans`` to ``size``, copy the inputs into the static buffers and plan."""
        padded = spans + [self._dummy] * (size - len(spans))
        batch = ForwardBatch.build(padded, self.device, decode=True)
        self._ids[:size].copy_(batch.input_ids)
        self._pos[:size].copy_(batch.positions)
        self._out[:size].copy_(batch.out_slots)
        static = dataclasses.replace(
            batch,
            input_ids=self._ids[:size],
            positions=self._pos[:size],
            out_slots=self._out[:size],
        )
        self.attn.plan(static)
        return static

    def _forward(self, batch: ForwardBatch) -> torch.Tensor:
        return self.model.compute_logits(self.model(batch, self.attn, planned=True))

    def _capture(self, size: int) -> None:
        batch = self._load([], size)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):  # compiles and first-call set-up happen outside capture
            for _ in range(2):
                self._forward(batch)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._mempool):
            self._logits[size] = self._forward(batch)
        self._graphs[size] = graph

    def run(self, spans: list[SeqSpan]) -> torch.Tensor:
        """Logits [len(spans), V] (float32) of one decode step over ``spans``."""
        size = next(s for s in self.sizes if s >= len(spans))
        static = self._load(spans, size)
        graph = self._graphs.get(size)
        if graph is None:
            return self._forward(static)[: len(spans)]
        graph.replay()
        self.replays += 1
        return self._logits[size][: len(spans)].clone()  # the buffer is the next replay's
