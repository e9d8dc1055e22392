"""The EP-rank bench's records (config, memory) and its printed table."""

from __future__ import annotations

import argparse
from dataclasses import asdict
from typing import Any

import torch

from dsv3serve.bench.ep_rank.setup import LOOPBACK_LABEL, KVChoice
from dsv3serve.bench.model.roofline import storage_bytes
from dsv3serve.engine.model_runner import ModelRunner
from dsv3serve.plan.planner import GB, RankPlan, describe

NOTES = (
    LOOPBACK_LABEL + ": the rank keeps, of each of ITS OWN tokens' top-8, only its local "
    "experts; no other rank's tokens arrive and nothing crosses a link. A real DP+EP rank "
    "also runs its experts on the other ranks' tokens (more experts hit at small batches) and "
    "waits for the all-to-all; neither is in these numbers.",
    "lm_head: enable_dp_lm_head keeps the whole lm_head (and embedding) on the rank; no gather.",
    "roofline: bytes the rank must read per step (attention in the absorbed form, dense MLP, "
    "router + shared expert, the local experts the recorded routing hits, the whole lm_head, "
    "every sequence's latents in every layer) / the copy bandwidth measured in this run "
    "(copy_TBps, bytes read + written per second, as `bench model`); ratio = ms / roofline_ms.",
    "routed experts: choices of experts on other ranks reach the fused MoE as id -1 and are "
    "skipped, so it reads only the local experts hit.",
    "graph_ms: one decode step through the runner's CUDA graph (host padding, attention plan, "
    "replay, logits copy), median of --iters after --warmup; eager_ms: the same step without "
    "graphs, median of --eager-iters.",
)


def config_record(
    args: argparse.Namespace, runner: ModelRunner, kv: KVChoice, dtype: torch.dtype
) -> dict[str, Any]:
    cfg, layout = runner.model_cfg, runner.parts.layout
    assert layout is not None
    experts = layout.expert_range(cfg.n_routed_experts)
    return {
        "layout": args.layout,
        "parallel": describe(layout.parallel),
        "rank": layout.rank,
        "preset": args.preset,
        "num_hidden_layers": cfg.num_hidden_layers,
        "num_dense_layers": cfg.first_k_dense_replace,
        "nextn": False,
        "n_routed_experts": cfg.n_routed_experts,
        "local_experts": [experts.start, experts.stop],
        "lm_head": "whole on the rank (enable_dp_lm_head)",
        "attention_backend": runner.cfg.attention_backend,
        "attention_kernel": type(runner.attn).__name__,
        "moe_backend": runner.cfg.moe_backend,
        "dtype": str(dtype),
        "page_size": runner.cfg.page_size,
        "kv": asdict(kv),
        "cuda_graph": runner.graphs is not None,
        "graph_batch_sizes": None if runner.graphs is None else runner.graphs.sizes,
        "notes": list(NOTES),
    }


def memory_record(runner: ModelRunner, planned: RankPlan) -> dict[str, Any]:
    """Planner bytes beside what the build holds (parameters, derived MLA, KV pool)."""
    model = runner.model
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    derived = [
        t for m in model.modules() for t in (getattr(m, "w_uk", None), getattr(m, "w_uv", None))
    ]
    record = {
        "planner_weights_GB": planned.weights_total / GB,
        "planner_weights_by_kind_GB": {k: v / GB for k, v in planned.weight_bytes.items()},
        "planner_absorbed_mla_GB": planned.absorbed_mla_bytes / GB,
        "built_parameters_GB": params / GB,
        "built_absorbed_mla_GB": storage_bytes([t for t in derived if t is not None]) / GB,
        "kv_cache_GB": runner.pool.nbytes / GB,
    }
    if runner.device.type == "cuda":
        record["memory_allocated_after_build_GB"] = torch.cuda.memory_allocated(runner.device) / GB
    return record


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def print_table(result: dict[str, Any]) -> None:
    """The decode rows as a table, with the memory comparison and the label."""
    mem, cfg = result["memory"], result["config"]
    print(f"\n{cfg['parallel']}, rank {cfg['rank']}: {LOOPBACK_LABEL}")
    print(f"lm_head: {cfg['lm_head']}; KV {cfg['kv']['kv_cache_dtype']} ({cfg['kv']['reason']})")
    built = mem.get("memory_allocated_after_build_GB")
    print(
        f"weights: planner {mem['planner_weights_GB']:.2f} GB + absorbed MLA "
        f"{mem['planner_absorbed_mla_GB']:.2f} GB; built {mem['built_parameters_GB']:.2f} + "
        f"{mem['built_absorbed_mla_GB']:.2f} GB; KV {mem['kv_cache_GB']:.2f} GB; "
        f"torch.cuda.memory_allocated after build {_fmt(built, '.2f')} GB"
    )
    print(f"copy ceiling {result['ceilings']['copy_TBps']:.3f} TB/s")
    head = f"{'bs':>4} {'ctx':>5} {'graph ms':>9} {'eager ms':>9} {'GB read':>8} "
    print(head + f"{'roof ms':>8} {'ratio':>6} {'experts hit':>11}  timed")
    for r in result["decode"]:
        _print_row(r)


def _print_row(r: dict[str, Any]) -> None:
    if "error" in r:
        print(f"{r['batch_size']:>4} {r['context']:>5}  error: {r['error']}")
        return
    hit = r["local_experts_hit"]["mean"]
    print(
        f"{r['batch_size']:>4} {r['context']:>5} {_fmt(r['graph_ms'], '9.3f')} "
        f"{r['eager_ms']:>9.3f} {r['total_bytes'] / GB:>8.2f} {r['roofline_ms']:>8.3f} "
        f"{r['ratio']:>6.2f} {hit:>11.1f}  {r['timed']}"
    )
