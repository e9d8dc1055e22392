"""``bench model``'s per-layer CUDA graphs: one target decoder layer captured alone.

A step's graph holds every layer of the bench model; DeepSeek-V3 has more (3 dense + 58
MoE). To add the missing ones to a graphed step cost, one dense and one MoE layer are
each captured alone at the step's shape (``batch_size`` sequences of ``tokens`` new tokens
over ``context`` cached ones: 1 token for decode, ``k + 1`` for a verify of ``k`` drafts)
and their replays timed: the pure GPU time of a layer, with no host work in the interval
(attention is planned once, before the capture, on an attention fork of its own).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from dsv3serve.bench.model.batches import context_batch
from dsv3serve.bench.model.spec_graphs import median_call_ms
from dsv3serve.engine.graph_capture import GraphCache, fork_attention
from dsv3serve.engine.model_runner import ModelRunner

LAYER_SLOT = "bench_layer"  # the flashinfer CUDA-graph wrappers the layer graphs plan into


@dataclass(frozen=True)
class LayerGraph:
    """One layer's captured forward: ``replay()`` its output [T, H] (the graph's buffer),
    ``eager()`` the same forward on the same inputs without the graph."""

    replay: Callable[[], torch.Tensor]
    eager: Callable[[], torch.Tensor]
    graphs: GraphCache[torch.Tensor]


class LayerGraphTimer:
    """Times CUDA-graph replays of single decoder layers of one runner's model."""

    def __init__(self, runner: ModelRunner, context: int, warmup: int, iters: int) -> None:
        self.runner, self.context, self.warmup, self.iters = runner, context, warmup, iters
        cfg = runner.model_cfg
        self.layers = {"dense": 0, "moe": cfg.first_k_dense_replace}
        if cfg.is_moe_layer(0) or not cfg.is_moe_layer(self.layers["moe"]):
            raise ValueError(
                f"expected layer 0 dense and layer {self.layers['moe']} MoE, got "
                f"first_k_dense_replace={cfg.first_k_dense_replace}"
            )

    def available(self, batch_size: int) -> bool:
        """CUDA, and the batch within the attention's CUDA-graph wrappers."""
        graphs = self.runner.graphs
        return graphs is not None and batch_size <= graphs.max_batch_size

    @torch.inference_mode()
    def capture(self, layer: int, batch_size: int, tokens: int) -> LayerGraph:
        """Decoder layer ``layer`` over ``batch_size`` sequences of ``tokens`` new tokens
        each (absorbed MLA, as decode and verify run), planned and captured."""
        r = self.runner
        page, vocab = r.cfg.page_size, r.model_cfg.vocab_size
        batch = context_batch(batch_size, self.context, tokens, page, vocab, r.device)
        attn = fork_attention(r.attn, LAYER_SLOT)
        attn.plan(batch)
        ctx = r.model.step_context(batch, attn, planned=True)
        g = torch.Generator(device=r.device).manual_seed(5)
        size = (batch.num_tokens, r.model_cfg.hidden_size)
        x = torch.randn(size, generator=g, device=r.device).to(r.dtype)
        block = r.model.layers[layer]

        def eager() -> torch.Tensor:
            with torch.inference_mode():
                return block(x, ctx)

        graphs: GraphCache[torch.Tensor] = GraphCache(r.device)
        graphs.capture(batch_size, eager)
        return LayerGraph(lambda: graphs.run(batch_size, eager), eager, graphs)

    def layer_ms(self, layer: int, batch_size: int, tokens: int) -> float:
        """Median ms of one replay of :meth:`capture`'s graph."""
        graph = self.capture(layer, batch_size, tokens)
        ms = median_call_ms(graph.replay, self.warmup, self.iters)
        assert graph.graphs.replays > 0, "the layer graph did not replay"
        return ms

    def times(self, batch_size: int, widths: list[int]) -> dict[str, dict[str, float]]:
        """``{kind: {tokens per sequence: ms}}`` for the dense and the MoE layer; graphs
        freed afterwards."""
        try:
            return {
                kind: {str(w): self.layer_ms(index, batch_size, w) for w in widths}
                for kind, index in self.layers.items()
            }
        finally:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
