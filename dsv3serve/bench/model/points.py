"""The points ``bench model`` measures on a built model: prefill, decode, draft, verify."""

from __future__ import annotations

import traceback
from typing import Any

import torch

from dsv3serve.bench.model.batches import context_batch, context_spans, prefill_batch
from dsv3serve.bench.model.layer_graphs import LayerGraphTimer
from dsv3serve.bench.model.mtp import ACCEPT_LENGTHS, GraphSpecCosts, SpecCosts, speedup_rows
from dsv3serve.bench.model.plan import Plan
from dsv3serve.bench.model.projection import project_full_depth, project_graph_costs
from dsv3serve.bench.model.roofline import Roofline, decode_roofline
from dsv3serve.bench.model.spec_graphs import SpecGraphTimer
from dsv3serve.bench.model.steps import draft_step, forward_step
from dsv3serve.bench.model.timing import (
    Marks,
    StepTime,
    layer_marks,
    time_decode_graph,
    time_step,
)
from dsv3serve.engine.model_runner import ModelRunner
from dsv3serve.engine.speculative.draft import NextNDraft
from dsv3serve.forward_batch import ForwardBatch


class ModelBench:
    """A built model runner and the plan; each method measures one point."""

    def __init__(self, runner: ModelRunner, plan: Plan, copy_TBps: float) -> None:
        self.runner, self.plan, self.copy_TBps = runner, plan, copy_TBps
        self.model, self.cfg = runner.model, runner.model_cfg
        self.marks = Marks(runner.device)

    def _batch(self, batch_size: int, context: int, new_tokens: int) -> ForwardBatch:
        page, vocab = self.runner.cfg.page_size, self.cfg.vocab_size
        return context_batch(batch_size, context, new_tokens, page, vocab, self.runner.device)

    def _time_forward(
        self, batch: ForwardBatch, rows: torch.Tensor, warmup: int, iters: int
    ) -> StepTime:
        step = forward_step(self.model, self.runner.attn, batch, rows)
        with layer_marks(self.model, self.marks):
            return time_step(step, self.marks, warmup, iters)

    def prefill(self, length: int) -> dict[str, Any]:
        """One sequence of ``length`` tokens, logits at the last."""
        batch = prefill_batch(length, self.cfg.vocab_size, self.runner.device)
        t = self._time_forward(batch, batch.logits_indices, 1, self.plan.prefill_iters)
        full_ms = project_full_depth(t.parts_ms, self.cfg)
        return {
            "ms": t.ms,
            "tokens_per_s": length / t.ms * 1e3,
            "parts_ms": t.parts_ms,
            "projected_61": {"ms": full_ms, "tokens_per_s": length / full_ms * 1e3},
        }

    def decode(self, batch_size: int, context: int) -> dict[str, Any]:
        """One decode step (logits of every sequence) against its per-layer roofline."""
        batch = self._batch(batch_size, context, 1)
        t = self._time_forward(batch, batch.logits_indices, self.plan.warmup, self.plan.iters)
        roof = decode_roofline(self.model, self.runner.pool, batch_size, context, self.copy_TBps)
        roof_ms = roof.bytes_ms(roof.total_bytes)
        full_ms = project_full_depth(t.parts_ms, self.cfg)
        full_roof_ms = roof.bytes_ms(project_full_depth(roof.bytes, self.cfg))
        graph_ms = self._time_graph(batch_size, context)
        return {
            "ms": t.ms,
            "tokens_per_s": batch_size / t.ms * 1e3,
            "roofline_ms": roof_ms,
            "ratio": t.ms / roof_ms,
            "graph_ms": graph_ms,
            "graph_ratio": None if graph_ms is None else graph_ms / roof_ms,
            "parts_ms": t.parts_ms,
            "layers": [self._part(name, t, roof) for name in roof.bytes if name != "head"],
            "head": self._part("head", t, roof),
            "projected_61": {
                "ms": full_ms,
                "tokens_per_s": batch_size / full_ms * 1e3,
                "roofline_ms": full_roof_ms,
                "ratio": full_ms / full_roof_ms,
            },
        }

    def _time_graph(self, batch_size: int, context: int) -> float | None:
        """Median ms of the whole decode step through the runner's CUDA graphs, or None."""
        page, vocab = self.runner.cfg.page_size, self.cfg.vocab_size
        spans = context_spans(batch_size, context, 1, page, vocab)
        return time_decode_graph(self.runner, spans, self.plan.warmup, self.plan.iters)

    def _part(self, name: str, t: StepTime, roof: Roofline) -> dict[str, Any]:
        index = int(name[len("layer") :]) if name.startswith("layer") else None
        kind = "head" if index is None else "moe" if self.cfg.is_moe_layer(index) else "dense"
        ms, roof_ms = t.parts_ms[name], roof.ms(name)
        return {"part": name, "kind": kind, "ms": ms, "bytes": roof.bytes[name],
                "roofline_ms": roof_ms, "ratio": ms / roof_ms}  # fmt: skip

    def draft(self, batch_size: int, context: int) -> StepTime:
        """One chained draft step: NextN layer + shared head over one token per sequence."""
        batch = self._batch(batch_size, context, 1)
        device, dtype = self.runner.device, self.runner.dtype
        g = torch.Generator(device=device).manual_seed(2)
        hidden = torch.randn(batch_size, self.cfg.hidden_size, generator=g, device=device)
        step = draft_step(NextNDraft(self.model), self.runner.attn, batch, hidden.to(dtype))
        return time_step(step, self.marks, self.plan.warmup, self.plan.iters)

    def verify(self, batch_size: int, context: int, num_steps: int) -> StepTime:
        """The target over ``num_steps + 1`` tokens per sequence, logits at every one."""
        batch = self._batch(batch_size, context, num_steps + 1)
        rows = torch.arange(batch.num_tokens, device=self.runner.device)
        return self._time_forward(batch, rows, self.plan.warmup, self.plan.iters)

    def spec_costs(self, batch_size: int, decode: dict[str, Any]) -> dict[str, Any]:
        """Draft and verify steps of ``batch_size`` sequences beside the decode step
        ``decode`` (a :meth:`decode` result at the MTP context), measured and projected."""
        context = self.plan.mtp_context
        draft = self.draft(batch_size, context)
        verify = {k: self.verify(batch_size, context, k) for k in self.plan.mtp_steps}
        full = {str(k): project_full_depth(v.parts_ms, self.cfg) for k, v in verify.items()}
        return {
            "decode_ms": decode["ms"],
            "draft_ms": draft.ms,
            "verify_ms": {str(k): v.ms for k, v in verify.items()},
            "projected_61": {"decode_ms": decode["projected_61"]["ms"], "verify_ms": full},
            "graph": self._spec_graph_costs(batch_size, decode),
        }

    def _spec_graph_costs(self, batch_size: int, decode: dict[str, Any]) -> dict[str, Any] | None:
        """Graphed draft step, chain, extend and verify beside the graphed decode step, or
        None without decode graphs for ``batch_size``."""
        timer = SpecGraphTimer(self.runner, self.plan.warmup, self.plan.iters)
        if decode.get("graph_ms") is None or not timer.available(batch_size):
            return None
        costs = timer.costs(batch_size, self.plan.mtp_context, list(self.plan.mtp_steps))
        graph = {"decode_ms": decode["graph_ms"], **costs}
        return {**graph, **self._graph_layers(batch_size, graph)}

    def _graph_layers(self, batch_size: int, graph: dict[str, Any]) -> dict[str, Any]:
        """Graphed dense and MoE layer times at the decode and verify shapes and the graphed
        steps projected to 61 layers with them (``layer_error`` instead if they failed)."""
        plan = self.plan
        timer = LayerGraphTimer(self.runner, plan.mtp_context, plan.warmup, plan.iters)
        widths = [1, *(k + 1 for k in plan.mtp_steps)]
        try:
            layer_ms = timer.times(batch_size, widths)
        except Exception as err:  # the measured graph costs are kept without the projection
            traceback.print_exc()
            return {"layer_ms": None, "layer_error": f"{type(err).__name__}: {err}"[:500]}
        return {
            "layer_ms": layer_ms,
            "projected_61": project_graph_costs(graph, layer_ms, self.cfg),
        }


def spec_summary(rows: list[dict[str, Any]], context: int, steps: list[int]) -> dict[str, Any]:
    """The MTP section: cost rows (failed ones kept, with their error) and the speedups."""
    ok = [r for r in rows if "error" not in r]

    def costs(projected: bool) -> dict[int, SpecCosts]:
        out = {}
        for r in ok:
            src = r["projected_61"] if projected else r
            verify = {int(k): v for k, v in src["verify_ms"].items()}
            out[r["batch_size"]] = SpecCosts(src["decode_ms"], r["draft_ms"], verify)
        return out

    return {
        "context": context,
        "num_steps": steps,
        "accept_lengths": [f"{a:.1f}" for a in ACCEPT_LENGTHS],
        "rows": rows,
        "speedup": speedup_rows(costs(False)),
        "speedup_projected_61": speedup_rows(costs(True)),
        "speedup_graph": speedup_rows(graph_costs(ok)),
        "speedup_graph_61": speedup_rows(graph_costs(ok, projected=True)),
    }


def graph_costs(rows: list[dict[str, Any]], projected: bool = False) -> dict[int, GraphSpecCosts]:
    """Round costs through CUDA graphs of the rows that measured them (the graphed extend
    where measured, else the eager draft step); ``projected``: with the decode and verify
    steps projected to 61 layers (rows whose layer graphs failed are left out)."""
    out = {}
    for r in rows:
        g = r.get("graph")
        if g is not None and projected:
            g = {**g, **g["projected_61"]} if g.get("projected_61") else None
        if g is not None:
            verify = {int(k): v for k, v in g["verify_ms"].items()}
            chain = {int(k): v for k, v in g["chain_ms"].items()}
            extend = {int(k): v for k, v in g.get("extend_ms", {}).items()}
            out[r["batch_size"]] = GraphSpecCosts(
                g["decode_ms"], r["draft_ms"], verify, chain, extend
            )
    return out
