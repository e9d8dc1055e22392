"""Print a :class:`~dsv3serve.plan.planner.Plan` as a table or JSON."""

from __future__ import annotations

import dataclasses

from dsv3serve.json_types import JSONObject
from dsv3serve.plan.planner import GB, KINDS, Plan, describe


def plan_table(p: Plan, model: str) -> str:
    """Per-rank GB by kind, totals, reserves and KV capacity, one row each."""
    s, w = p.settings, p.worst
    rows = [(kind, w.weight_bytes[kind] / GB) for kind in KINDS]
    rows += [
        ("weights total", w.weights_total / GB),
        ("absorbed MLA (derived)", w.absorbed_mla_bytes / GB),
        ("CUDA-graph reserve", p.graph_reserve_bytes / GB),
        ("activation reserve", p.activation_reserve_bytes / GB),
        *_deepep_rows(p),
        ("KV cache", p.kv_bytes / GB),
        ("total", (p.fixed_bytes + p.kv_bytes) / GB),
    ]
    lines = [
        f"model {model}, layout {describe(p.parallel)}: {len(p.ranks)} ranks, {_symmetry(p)}",
        f"budget per rank {p.budget_bytes / GB:.2f} GB = {s.gpu_memory_gb:g} GB x "
        f"mem_fraction_static {s.mem_fraction_static:g}",
        f"{'per rank':<24} {'GB':>9}",
    ]
    lines += [f"{name:<24} {gb:>9.2f}" for name, gb in rows]
    lines.append(
        f"KV capacity: {p.kv_tokens} tokens ({p.kv_tokens // s.page_size} pages of "
        f"{s.page_size}, kv_cache_dtype {s.kv_cache_dtype}, {p.kv_bytes_per_token} bytes per "
        f"token), floor {p.min_kv_tokens}"
    )
    if p.host_kv_tokens:
        lines.append(
            f"host tier (hierarchical cache): {p.host_kv_bytes / GB:.2f} GB host memory per "
            f"rank, {p.host_kv_bytes * len(p.ranks) / GB:.2f} GB for the group, "
            f"{p.host_kv_tokens} tokens per rank"
        )
    return "\n".join(lines)


def _deepep_rows(p: Plan) -> list[tuple[str, float]]:
    """DeepEP's buffers (``moe_a2a_backend`` ``deepep``), one row each."""
    d = p.deepep
    if d is None:
        return []
    return [
        ("DeepEP NVLink (normal)", d.nvl / GB),
        ("DeepEP RDMA (low-lat.)", d.rdma / GB),
        ("DeepEP low-lat. activ.", d.activations / GB),
    ]


def _symmetry(p: Plan) -> str:
    totals = {r.static_total for r in p.ranks}
    if len(totals) == 1:
        return "every rank the same (rank 0 shown)"
    return f"ranks differ (worst, rank {p.worst.rank}, shown)"


def plan_json(p: Plan, model: str, fits: bool) -> JSONObject:
    """The plan as JSON-ready data (bytes, not GB), every rank listed."""
    return {
        "model": model,
        "parallel": p.parallel.model_dump(),
        "settings": dataclasses.asdict(p.settings),
        "budget_bytes": p.budget_bytes,
        "ranks": [
            {
                "rank": r.rank,
                "weight_bytes": r.weight_bytes,
                "weights_total": r.weights_total,
                "absorbed_mla_bytes": r.absorbed_mla_bytes,
            }
            for r in p.ranks
        ],
        "graph_reserve_bytes": p.graph_reserve_bytes,
        "activation_reserve_bytes": p.activation_reserve_bytes,
        "deepep_bytes": None if p.deepep is None else dataclasses.asdict(p.deepep),
        "kv_bytes_per_token": p.kv_bytes_per_token,
        "kv_tokens": p.kv_tokens,
        "min_kv_tokens": p.min_kv_tokens,
        "host_kv_tokens": p.host_kv_tokens,
        "host_kv_bytes": p.host_kv_bytes,
        "fits": fits,
    }
