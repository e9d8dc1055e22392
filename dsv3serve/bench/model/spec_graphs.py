"""``bench model``'s MTP steps through CUDA graphs: a draft step, the chain, the verify,
the draft extend.

Each is timed as the engine runs it (host padding, copies and planning included, then
the replay), with graphs captured for the measured batch size only, in a memory pool of
their own that is freed after the point.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

import torch

from dsv3serve.bench.model.batches import context_spans
from dsv3serve.engine.graph_capture import GraphSetup
from dsv3serve.engine.model_runner import ModelRunner
from dsv3serve.engine.speculative.draft import NextNDraft
from dsv3serve.engine.speculative.extend_graphs import ExtendGraphs
from dsv3serve.engine.speculative.graphs import DraftChainGraphs, VerifyGraphs
from dsv3serve.forward_batch import SeqSpan


def median_call_ms(run: Callable[[], Any], warmup: int, iters: int) -> float:
    """Median ms of ``run()`` from a device event before it to one after (host included)."""
    for _ in range(warmup):
        run()
    times = []
    for _ in range(iters):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def chain_steps(spans: list[SeqSpan], num_steps: int) -> list[list[SeqSpan]]:
    """The ``num_steps - 1`` chained draft steps over the verify ``spans``' first slots,
    by page table where the spans have one (as the engine gives them)."""

    def step(s: SeqSpan, i: int) -> SeqSpan:
        if s.page_table is None:  # a slot-list span
            return SeqSpan([s.token_ids[0]], s.start + i, s.kv_slots[: s.start + i + 1])
        return SeqSpan.from_pages([s.token_ids[0]], s.start + i, s.page_table, s.page_size)

    return [[step(s, i) for s in spans] for i in range(num_steps - 1)]


class SpecGraphTimer:
    """Times the graphed MTP steps of one runner (CUDA, flashinfer, decode graphs on)."""

    def __init__(self, runner: ModelRunner, warmup: int, iters: int) -> None:
        self.runner, self.warmup, self.iters = runner, warmup, iters
        self.draft = NextNDraft(runner.model)

    def available(self, batch_size: int) -> bool:
        graphs = self.runner.graphs
        return graphs is not None and batch_size <= graphs.max_batch_size

    def _spans(self, batch_size: int, context: int, num_steps: int) -> list[SeqSpan]:
        page, vocab = self.runner.cfg.page_size, self.runner.model_cfg.vocab_size
        return context_spans(batch_size, context, num_steps + 1, page, vocab)

    def _hidden(self, batch_size: int) -> torch.Tensor:
        r = self.runner
        g = torch.Generator(device=r.device).manual_seed(3)
        size = (batch_size, r.model_cfg.hidden_size)
        return torch.randn(size, generator=g, device=r.device).to(r.dtype)

    def chain_call(
        self, batch_size: int, context: int, num_steps: int
    ) -> tuple[Callable[[], torch.Tensor], DraftChainGraphs]:
        """A call of the ``num_steps - 1`` chained draft steps as the engine makes it (host
        padding and planning, then the replay of their one graph), and the graphs."""
        r = self.runner
        scratch = r.scratch_slots(1)
        chain = DraftChainGraphs(self.draft, num_steps, GraphSetup(r.attn, [batch_size], scratch))
        steps = chain_steps(self._spans(batch_size, context, num_steps), num_steps)
        hidden = self._hidden(batch_size)
        return lambda: chain.run(steps, hidden), chain

    def chain_ms(self, batch_size: int, context: int, num_steps: int) -> float:
        """The ``num_steps - 1`` chained draft steps, a graph each (``num_steps=2``: one step)."""
        call, chain = self.chain_call(batch_size, context, num_steps)
        ms = median_call_ms(call, self.warmup, self.iters)
        assert chain.replays > 0, "the chain did not replay its graph"
        return ms

    def verify_call(
        self, batch_size: int, context: int, num_steps: int
    ) -> Callable[[], tuple[torch.Tensor, torch.Tensor]]:
        """A graphed verify call as the engine makes it (its graph captured here)."""
        r = self.runner
        scratch = r.scratch_slots(num_steps + 1)
        verify = VerifyGraphs(r.model, num_steps, GraphSetup(r.attn, [batch_size], scratch))
        spans = self._spans(batch_size, context, num_steps)

        def call() -> tuple[torch.Tensor, torch.Tensor]:
            out = verify.run(spans)
            assert verify.replays > 0, "the verify did not replay its graph"
            return out

        return call

    def verify_ms(self, batch_size: int, context: int, num_steps: int) -> float:
        """The target over ``num_steps + 1`` tokens per sequence, logits at every one."""
        return median_call_ms(self.verify_call(batch_size, context, num_steps),
                              self.warmup, self.iters)  # fmt: skip

    def extend_ms(self, batch_size: int, context: int, num_steps: int) -> float:
        """The draft over all ``num_steps + 1`` positions per sequence after a verify, the
        next draft states gathered at the last (the cost does not depend on which)."""
        r, width = self.runner, num_steps + 1
        scratch = r.scratch_slots(width)
        extend = ExtendGraphs(self.draft, num_steps, GraphSetup(r.attn, [batch_size], scratch))
        spans = self._spans(batch_size, context, num_steps)
        hidden = self._hidden(batch_size * width)
        rows = [i * width + num_steps for i in range(batch_size)]
        ms = median_call_ms(lambda: extend.run(spans, hidden, rows), self.warmup, self.iters)
        assert extend.replays > 0, "the extend did not replay its graph"
        return ms

    def costs(self, batch_size: int, context: int, steps: list[int]) -> dict[str, Any]:
        """Graphed draft step, chain, verify and extend per ``k`` (ms); graphs freed
        afterwards."""
        try:
            return {
                "draft_ms": self.chain_ms(batch_size, context, 2),
                "chain_ms": {str(k): self.chain_ms(batch_size, context, k) for k in steps if k > 1},
                "verify_ms": {str(k): self.verify_ms(batch_size, context, k) for k in steps},
                "extend_ms": {str(k): self.extend_ms(batch_size, context, k) for k in steps},
            }
        finally:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
