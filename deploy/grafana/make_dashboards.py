"""Write the Grafana dashboards of dsv3serve (JSON) from the panel lists below.

    python deploy/grafana/make_dashboards.py          # rewrite the JSON files
    python deploy/grafana/make_dashboards.py --check  # fail if they are out of date

Every query filters on the ``$model`` variable and uses ``$__rate_interval``;
tests/e2e/test_metrics_prometheus.py runs each one against a live app and Prometheus.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
M = 'model=~"$model"'
RI = "[$__rate_interval]"


def quantiles(metric: str, selector: str, by: str = "") -> list[tuple[str, str]]:
    """p50 / p90 / p99 of a histogram, optionally split by labels."""
    group = f"le{', ' + by if by else ''}"
    legend = f"{{{{{by}}}}} " if by else ""
    return [
        (
            f"histogram_quantile({q}, sum by ({group}) "
            f"(rate(dsv3serve:{metric}_bucket{{{selector}}}{RI})))",
            f"{legend}p{int(q * 100)}",
        )
        for q in (0.5, 0.9, 0.99)
    ]


def rate(metric: str, selector: str, by: str = "") -> str:
    return f"sum{f' by ({by})' if by else ''} (rate(dsv3serve:{metric}{{{selector}}}{RI}))"


ROUTER = f'role="router", {M}'
OVERVIEW = [
    ("Requests/s by status", "reqps", [(rate("requests_total", ROUTER, "status"), "{{status}}")]),
    ("Token throughput", "short", [
        (rate("generation_tokens_total", ROUTER), "generated tok/s"),
        (rate("prompt_tokens_total", ROUTER), "prompt tok/s"),
    ]),
    ("Time to first token", "s", quantiles("time_to_first_token_seconds", ROUTER)),
    ("Inter-token latency", "s", quantiles("inter_token_latency_seconds", ROUTER)),
    ("End-to-end latency", "s", quantiles("e2e_request_latency_seconds", ROUTER)),
    ("Errors/s (4xx, 5xx)", "reqps", [
        (rate("requests_total", f'{ROUTER}, status=~"4..|5.."', "status"), "{{status}}"),
    ]),
    ("Finished requests/s by reason", "reqps", [
        (rate("request_success_total", ROUTER, "finished_reason"), "{{finished_reason}}"),
    ]),
    ("Queue", "short", [
        (f"sum by (role) (dsv3serve:num_requests_waiting{{{M}}})", "waiting {{role}}"),
        (f"sum by (role) (dsv3serve:num_requests_running{{{M}}})", "running {{role}}"),
        (f"sum(dsv3serve:num_requests_waiting_for_kv{{{ROUTER}}})", "waiting for KV"),
    ]),
]  # fmt: skip

DECODE = f'role="decode", {M}'
PD = [
    ("KV transfer latency", "s", quantiles("kv_transfer_latency_seconds", DECODE)),
    ("KV transfer bandwidth (GB/s)", "short", [
        (f"{rate('kv_transfer_bytes_total', DECODE)} / 1e9", "moved"),
        (f"histogram_quantile(0.5, sum by (le) (rate("
         f"dsv3serve:kv_transfer_speed_bytes_per_second_bucket{{{DECODE}}}{RI}))) / 1e9",
         "median per transfer"),
    ]),
    ("KV bytes per transfer", "bytes", quantiles("kv_transfer_size_bytes", DECODE)),
    ("KV transfer failures/s", "short", [
        (rate("kv_transfer_failures_total", DECODE, "reason"), "{{reason}}"),
    ]),
    ("Requests waiting for KV / in transfer", "short", [
        (f"sum(dsv3serve:num_requests_waiting_for_kv{{{ROUTER}}})", "waiting for reservation"),
        (f"sum(dsv3serve:num_requests_in_transfer{{{DECODE}}})", "in transfer"),
    ]),
    ("Prefill to decode handoff", "s", quantiles("pd_handoff_seconds", ROUTER)),
    ("Prefill time", "s", quantiles("request_prefill_time_seconds", f'role="prefill", {M}')),
    ("Decode time", "s", quantiles("request_decode_time_seconds", DECODE)),
    ("Running requests by replica", "short", [
        (f"sum by (role, replica) (dsv3serve:num_requests_running{{{M}}})",
         "{{role}} {{replica}}"),
    ]),
    ("Decode load by DP rank", "short", [
        (f"sum by (replica, dp_rank) (dsv3serve:num_requests_running{{{DECODE}}})",
         "{{replica}} rank {{dp_rank}} running"),
        (f"sum by (replica, dp_rank) (dsv3serve:num_requests_waiting{{{DECODE}}})",
         "{{replica}} rank {{dp_rank}} waiting"),
    ]),
    ("Decode prefix-cache hit rate by DP rank", "percentunit", [
        (f"{rate('prefix_cache_hits_total', DECODE, 'replica, dp_rank')} / clamp_min("
         f"{rate('prefix_cache_queries_total', DECODE, 'replica, dp_rank')}, 1)",
         "{{replica}} rank {{dp_rank}}"),
    ]),
    ("KV pages pulled vs reused by decode (pages/s)", "short", [
        (rate("kv_transfer_pages_total", DECODE), "pulled"),
        (rate("kv_transfer_reused_pages_total", DECODE), "reused (decode-side prefix hit)"),
        (rate("kv_transfer_overlapped_pages_total", DECODE), "pulled while prefill ran"),
    ]),
    ("KV transfer overlapped with prefill (share of pulled pages)", "percentunit", [
        (f"{rate('kv_transfer_overlapped_pages_total', DECODE)} / clamp_min("
         f"{rate('kv_transfer_pages_total', DECODE)}, 1)", "overlapped"),
    ]),
    ("Requests placed per DP rank/s", "reqps", [
        (rate("dp_rank_requests_total", M, "role, dp_rank"), "{{role}} rank {{dp_rank}}"),
        (rate("dp_rank_fallbacks_total", M, "role, dp_rank"),
         "{{role}} rank {{dp_rank}} fallback"),
    ]),
    # SLO autoscaling (docs/autoscaling.md): measured p99 against the target, the replicas
    # each role runs as the router sees them, and the policy's changes with their reasons
    # (Ray's metric, from Serve's controller).
    ("Autoscaling: p99 TTFT and ITL vs SLO target", "s", [
        (quantiles("time_to_first_token_seconds", ROUTER)[2][0], "TTFT p99"),
        (f'max(dsv3serve:slo_target_seconds{{{ROUTER}, slo="ttft_p99"}})', "TTFT target"),
        (quantiles("inter_token_latency_seconds", ROUTER)[2][0], "ITL p99"),
        (f'max(dsv3serve:slo_target_seconds{{{ROUTER}, slo="itl_p99"}})', "ITL target"),
    ]),
    ("Autoscaling: worker replicas per role", "short", [
        (f"max by (pool) (dsv3serve:autoscale_replicas{{{ROUTER}}})", "{{pool}}"),
    ]),
    ("Autoscaling: decisions by reason (per 5 min)", "short", [
        ("sum by (role, direction, reason) "
         "(increase(ray_dsv3serve_autoscale_decisions_total[5m]))",
         "{{role}} {{direction}} ({{reason}})"),
    ]),
]  # fmt: skip

ENGINE = [
    ("Batch size (sequences per step)", "short",
     quantiles("batch_size", M, "role")),
    ("Tokens per step", "short", quantiles("step_num_tokens", M, "role")),
    ("KV cache usage", "percentunit", [
        (f"max by (role, replica) (dsv3serve:kv_cache_usage_perc{{{M}}})", "{{role}} {{replica}}"),
        (f"sum by (role) (dsv3serve:hicache_host_used_pages{{{M}}}) / clamp_min("
         f"sum by (role) (dsv3serve:hicache_host_pages{{{M}}}), 1)", "{{role}} host tier"),
    ]),
    ("Prefix cache hit rate", "percentunit", [
        (f"{rate('prefix_cache_hits_total', M, 'role')} / clamp_min("
         f"{rate('prefix_cache_queries_total', M, 'role')}, 1)", "{{role}}"),
    ]),
    ("Preemptions/s", "short", [(rate("num_preemptions_total", M, "role"), "{{role}}")]),
    ("Prompt tokens/s: GPU hits, host-tier hits, computed", "short", [
        (f"{rate('prefix_cache_hits_total', M, 'role')} - "
         f"{rate('prefix_cache_host_hits_total', M, 'role')}", "{{role}} GPU pool hit"),
        (rate("prefix_cache_host_hits_total", M, "role"), "{{role}} host tier hit"),
        (rate("prefill_tokens_computed_total", M, "role"), "{{role}} computed"),
    ]),
    ("Hierarchical cache: pages/s loaded back and backed up", "short", [
        (rate("hicache_loaded_pages_total", M, "role"), "{{role}} loaded back"),
        (rate("hicache_backed_up_pages_total", M, "role"), "{{role}} backed up"),
    ]),
    ("Hierarchical cache: load-back time per page", "s", [
        (f"{rate('hicache_load_seconds_total', M, 'role')} / clamp_min("
         f"{rate('hicache_loaded_pages_total', M, 'role')}, 1)", "{{role}}"),
    ]),
    ("Queue time", "s", quantiles("request_queue_time_seconds", M, "role")),
    ("Speculative decoding acceptance", "percentunit", [
        (f"{rate('spec_decode_num_accepted_tokens_total', M)} / clamp_min("
         f"{rate('spec_decode_num_draft_tokens_total', M)}, 1)", "accepted / drafted"),
    ]),
    ("MoE dispatch / combine latency per EP rank (p50, p99)", "s", [
        (f"histogram_quantile({q}, sum by (le, replica, rank, phase) "
         f"(rate(dsv3serve:moe_dispatch_seconds_bucket{{{M}}}{RI})))",
         f"{{{{replica}}}} rank {{{{rank}}}} {{{{phase}}}} p{int(q * 100)}")
        for q in (0.5, 0.99)
    ]),
    ("MoE dispatch / combine bytes/s per EP rank", "Bps", [
        (rate("moe_dispatch_bytes_total", M, "replica, rank, phase"),
         "{{replica}} rank {{rank}} {{phase}}"),
    ]),
]  # fmt: skip

DASHBOARDS = {
    "dsv3serve-overview.json": ("dsv3serve / serving overview", OVERVIEW),
    "dsv3serve-pd.json": ("dsv3serve / prefill-decode and KV transfer", PD),
    "dsv3serve-engine.json": ("dsv3serve / engine internals", ENGINE),
}


def panel(i: int, title: str, unit: str, targets: list[tuple[str, str]]) -> dict[str, Any]:
    return {
        "id": i + 1,
        "type": "timeseries",
        "title": title,
        "datasource": {"type": "prometheus", "uid": "${datasource}"},
        "gridPos": {"h": 8, "w": 12, "x": 12 * (i % 2), "y": 8 * (i // 2)},
        "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
        "targets": [
            {"refId": chr(65 + j), "expr": expr, "legendFormat": legend}
            for j, (expr, legend) in enumerate(targets)
        ],
    }


def dashboard(uid: str, title: str, panels: list[Any]) -> dict[str, Any]:
    return {
        "uid": uid,
        "title": title,
        "tags": ["dsv3serve"],
        "schemaVersion": 39,
        "time": {"from": "now-1h", "to": "now"},
        "refresh": "10s",
        "templating": {
            "list": [
                {"name": "datasource", "type": "datasource", "query": "prometheus"},
                {
                    "name": "model",
                    "type": "query",
                    "datasource": {"type": "prometheus", "uid": "${datasource}"},
                    "query": "label_values(dsv3serve:num_requests_running, model)",
                    "includeAll": True,
                    "allValue": ".*",
                    "current": {"text": "All", "value": "$__all"},
                },
            ]
        },
        "panels": [panel(i, *p) for i, p in enumerate(panels)],
    }


def render() -> dict[str, str]:
    """File name -> JSON text of every dashboard."""
    return {
        name: json.dumps(dashboard(name.removesuffix(".json"), title, panels), indent=2) + "\n"
        for name, (title, panels) in DASHBOARDS.items()
    }


def main(argv: list[str]) -> int:
    rendered = render()
    if "--check" in argv:
        stale = [
            name
            for name, text in rendered.items()
            if not (HERE / name).exists() or (HERE / name).read_text() != text
        ]
        print("out of date: " + ", ".join(stale) if stale else "dashboards are up to date")
        return 1 if stale else 0
    for name, text in rendered.items():
        (HERE / name).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
