"""CUDA graphs for decode steps: one graph per captured batch size, replayed after planning.

A decode batch of ``b`` sequences runs on the smallest captured size ``B >= b``. The ``B - b``
padding rows are dummy sequences of one token over a scratch page that the allocator never
hands out, so their latent writes and attention reads touch nothing real. Per step, the host
builds the padded batch, copies its token ids, positions and output slots into the graph's
static buffers, plans attention (flashinfer's CUDA-graph wrappers keep fixed buffers, so the
captured kernels read the new plan), replays, and slices the first ``b`` logits rows.

In a group every rank replays the same size: under TP all ranks hold the same batch, and
under DP attention the leader picks the size from every rank's batch (:meth:`run_padded`; a
rank without sequences replays dummies) and the forward runs as a uniform batch, so its
collectives need no host-side row counts.

Prefill and extend steps stay eager; speculative decoding's verify and chained draft
steps have graphs of their own (:mod:`dsv3serve.engine.speculative.graphs`), built on the same
helpers (:mod:`dsv3serve.engine.graph_capture`) and memory pool.
"""

from __future__ import annotations

import logging
from functools import partial

import torch

from dsv3serve.attention.base import AttentionBackend
from dsv3serve.engine.compile import CompiledDecodeModel
from dsv3serve.engine.graph_capture import (
    GraphCache,
    GraphPool,
    pad_spans,
    padded_size,
    plan_for_graph,
)
from dsv3serve.engine.static_inputs import StaticInputs
from dsv3serve.forward_batch import ForwardBatch, SeqSpan
from dsv3serve.model.deepseek_v3 import DeepseekV3ForCausalLM
from dsv3serve.parallel.uniform import uniform_batch

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
        model: DeepseekV3ForCausalLM | CompiledDecodeModel,
        attn: AttentionBackend,
        device: torch.device,
        sizes: list[int],
        scratch_slot: int,
        capture: bool = True,
        mempool: GraphPool | None = None,
    ) -> None:
        """``capture=False`` keeps the padded static-buffer path but runs it eagerly (CPU
        tests of the padding, and a fallback). ``mempool``: a CUDA graph memory pool to
        share with the engine's other graphs (one of its own when None)."""
        self.model, self.attn, self.device = model, attn, device
        self.sizes = sorted(sizes)
        self._dummy = SeqSpan([0], 0, [scratch_slot], True)
        self._inputs = StaticInputs(self.sizes[-1], scratch_slot, device)
        self._graphs: GraphCache[torch.Tensor] = GraphCache(device, mempool)
        self.steps = 0  # decode steps run on the padded path (replayed, or eager uncaptured)
        if capture:
            for size in reversed(self.sizes):  # largest first: later graphs reuse its memory
                batch = self._load([], size)
                self._graphs.capture(size, partial(self._forward, batch))
            logger.info("captured decode CUDA graphs for batch sizes %s", self.sizes)

    @property
    def max_batch_size(self) -> int:
        return self.sizes[-1]

    def release(self) -> None:
        """Free the captured graphs; steps run eagerly on the same padded path after."""
        self._graphs.release()

    @property
    def replays(self) -> int:
        """Decode steps served by a graph."""
        return self._graphs.replays

    def can_run(self, spans: list[SeqSpan]) -> bool:
        return graphable(spans, self.max_batch_size)

    def _load(self, spans: list[SeqSpan], size: int) -> ForwardBatch:
        """Pad ``spans`` to ``size``, copy the inputs into the static buffers and plan."""
        padded = pad_spans(spans, size, self._dummy)
        static = self._inputs.build(padded, real=len(spans))  # one token per decode span
        plan_for_graph(self.attn, static)
        return static

    def _forward(self, batch: ForwardBatch) -> torch.Tensor:
        with uniform_batch(batch.num_tokens, self._inputs.real):
            return self.model.compute_logits(self.model(batch, self.attn, planned=True))

    def run(self, spans: list[SeqSpan]) -> torch.Tensor:
        """Logits [len(spans), V] (float32) of one decode step over ``spans``."""
        return self.run_padded(spans, padded_size(self.sizes, len(spans)))

    def run_padded(self, spans: list[SeqSpan], size: int) -> torch.Tensor:
        """:meth:`run` on the graph of ``size`` (a captured size ``>= len(spans)``, chosen
        by the group; ``spans`` may be empty: a rank with nothing to decode this step)."""
        if size not in self.sizes or len(spans) > size:
            raise ValueError(f"expected a captured size >= {len(spans)}, got {size}")
        static = self._load(spans, size)
        self.steps += 1
        logits = self._graphs.run(size, lambda: self._forward(static))
        return logits[: len(spans)].clone()  # a graph's buffer is the next replay's
