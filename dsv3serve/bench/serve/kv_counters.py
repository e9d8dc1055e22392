"""The decode replicas' KV transfer counters, read from the router's ``/metrics`` around a run.

What a run moved from prefill to decode (pages and bytes pulled) and what decode-side
prefix reuse spared it (prompt pages the decode replica's own cache held, not pulled), and
how many of the pulled pages moved while their prefill still ran (overlapped transfer),
and how many pulls there were and how long they took in all: the difference of the
counters summed over decode replicas, after minus before. Beside them, the prefill work
(:data:`PREFILL_COUNTERS`, summed over prefill and colocated replicas): prompt tokens
computed, prefix-cache hits, and the hierarchical cache's host-tier hits and pages loaded
back.
"""

from __future__ import annotations

from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

# record key -> the counter sample (dsv3serve/metrics.py), summed over role="decode"
KV_COUNTERS = {
    "kv_pages_pulled": "dsv3serve:kv_transfer_pages_total",
    "kv_pages_reused": "dsv3serve:kv_transfer_reused_pages_total",
    "kv_pages_overlapped": "dsv3serve:kv_transfer_overlapped_pages_total",
    "kv_bytes_pulled": "dsv3serve:kv_transfer_bytes_total",
    # every pull (an overlapped range or the final pages) is one observation
    "kv_pulls": "dsv3serve:kv_transfer_latency_seconds_count",
    "kv_pull_seconds": "dsv3serve:kv_transfer_latency_seconds_sum",
}
# record key -> the counter sample, summed over role="prefill" and role="colocated"
PREFILL_COUNTERS = {
    "prefill_tokens_computed": "dsv3serve:prefill_tokens_computed_total",
    "prefix_hit_tokens": "dsv3serve:prefix_cache_hits_total",
    "host_tier_hit_tokens": "dsv3serve:prefix_cache_host_hits_total",
    "host_tier_loaded_pages": "dsv3serve:hicache_loaded_pages_total",
    "host_tier_load_seconds": "dsv3serve:hicache_load_seconds_total",
}
COUNTERS = KV_COUNTERS | PREFILL_COUNTERS
_PREFILL_ROLES = ("prefill", "colocated")


def parse_kv_counters(text: str) -> dict[str, float]:
    """Each of :data:`KV_COUNTERS` summed over the decode replicas in ``text``, each of
    :data:`PREFILL_COUNTERS` over the prefill and colocated ones (0 if absent)."""
    wanted = {sample: key for key, sample in COUNTERS.items()}
    totals = dict.fromkeys(COUNTERS, 0.0)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            key = wanted.get(sample.name)
            if key is not None and sample.labels.get("role") in _roles(key):
                totals[key] += sample.value
    return totals


def _roles(key: str) -> tuple[str, ...]:
    return ("decode",) if key in KV_COUNTERS else _PREFILL_ROLES


async def read_kv_counters(
    client: httpx.AsyncClient, urls: tuple[str, ...]
) -> dict[str, float] | None:
    """The counters summed over ``urls`` (every router replica's ``/metrics``; only router-0
    merges the workers' series, so each worker counts once), or None without any."""
    if not urls:
        return None
    totals = dict.fromkeys(COUNTERS, 0.0)
    for url in urls:
        response = await client.get(url)
        response.raise_for_status()
        for key, value in parse_kv_counters(response.text).items():
            totals[key] += value
    return totals


def kv_moved(before: dict[str, float] | None, after: dict[str, float] | None) -> dict[str, Any]:
    """The run's share of each counter (after - before); empty without a metrics URL."""
    if before is None or after is None:
        return {}
    return {key: after[key] - before[key] for key in COUNTERS}
