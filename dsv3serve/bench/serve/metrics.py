"""Aggregate metrics of one serving benchmark, its results table and its JSON record."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from dsv3serve.bench.serve.client import RequestResult

LATENCIES = ("ttft", "tpot", "itl", "e2e_latency")
STATS = ("mean", "median", "std", "p99")


def tpot_s(r: RequestResult) -> float | None:
    """Time per output token after the first: ``(e2e - ttft) / (output_tokens - 1)``."""
    return (r.e2e_s - r.ttft_s) / (r.output_tokens - 1) if r.output_tokens > 1 else None


def _stats_ms(name: str, values_s: Sequence[float]) -> dict[str, float]:
    """``mean_<name>_ms`` etc.; NaN (written as null) where there are no values."""
    ms = np.asarray(values_s, dtype=np.float64) * 1000.0
    if ms.size == 0:
        return {f"{s}_{name}_ms": math.nan for s in STATS}
    return {
        f"mean_{name}_ms": float(ms.mean()),
        f"median_{name}_ms": float(np.median(ms)),
        f"std_{name}_ms": float(ms.std()),
        f"p99_{name}_ms": float(np.percentile(ms, 99)),
    }


def _latency_values(ok: list[RequestResult]) -> dict[str, list[float]]:
    tpots = [t for t in map(tpot_s, ok) if t is not None]
    return {
        "ttft": [r.ttft_s for r in ok],
        "tpot": tpots,
        "itl": [gap for r in ok for gap in r.itl_s],
        "e2e_latency": [r.e2e_s for r in ok],
    }


def _server_input(ok: list[RequestResult]) -> int | None:
    counts = [r.server_prompt_tokens for r in ok]
    return sum(counts) if counts and None not in counts else None  # type: ignore[arg-type]


def summarize(results: list[RequestResult], duration_s: float) -> dict[str, Any]:
    """The benchmark's totals, throughputs and latency statistics (successful requests).

    ``total_input_tokens`` counts prompts as the dataset built them (BOS included);
    ``total_input_tokens_server`` is the servers' ``usage.prompt_tokens`` sum, which for
    chat includes the template. ``concurrency`` is the sum of E2E latencies / duration.
    """
    ok = [r for r in results if r.success]
    inp = sum(r.prompt_len for r in ok)
    out = sum(r.output_tokens for r in ok)
    summary: dict[str, Any] = {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "duration_s": duration_s,
        "total_input_tokens": inp,
        "total_input_tokens_server": _server_input(ok),
        "total_output_tokens": out,
        "request_throughput": len(ok) / duration_s,
        "input_throughput": inp / duration_s,
        "output_throughput": out / duration_s,
        "total_throughput": (inp + out) / duration_s,
        "concurrency": sum(r.e2e_s for r in ok) / duration_s,
    }
    for name, values in _latency_values(ok).items():
        summary |= _stats_ms(name, values)
    return summary


def per_request(results: list[RequestResult]) -> dict[str, list[Any]]:
    """Per-request lists, in send order (seconds; zeros for failed requests)."""
    return {
        "input_lens": [r.prompt_len for r in results],
        "server_prompt_tokens": [r.server_prompt_tokens for r in results],
        "output_lens": [r.output_tokens for r in results],
        "requested_output_lens": [r.output_len for r in results],
        "start_times_s": [r.start_s for r in results],
        "ttfts_s": [r.ttft_s for r in results],
        "itls_s": [r.itl_s for r in results],
        "e2e_latencies_s": [r.e2e_s for r in results],
        "success": [r.success for r in results],
        "errors": [r.error for r in results],
    }


def jsonable(value: Any) -> Any:
    """``value`` with NaN as None and infinities as "inf" / "-inf" (strict JSON has neither)."""
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, float) and math.isinf(value):
        return "inf" if value > 0 else "-inf"
    if isinstance(value, dict):
        return {k: jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [jsonable(v) for v in value]
    return value


def _line(label: str, value: Any) -> str:
    shown = f"{value:.2f}" if isinstance(value, float) else str(value)
    return f"{label + ':':<42}{shown:>12}"


def _latency_lines(title: str, name: str, s: dict[str, Any]) -> list[str]:
    rows = [f"{title:-^54}"]
    for stat, label in (("mean", "Mean"), ("median", "Median"), ("p99", "P99")):
        rows.append(_line(f"{label} {title} (ms)", s[f"{stat}_{name}_ms"]))
    return rows


def format_table(summary: dict[str, Any], header: dict[str, Any]) -> str:
    """SGLang-style text table of one run; ``header`` lines (label -> value) come first."""
    rows = [f"{' Serving Benchmark Result ':=^54}"]
    rows += [_line(k, v) for k, v in header.items()]
    labels = {
        "completed": "Successful requests",
        "failed": "Failed requests",
        "duration_s": "Benchmark duration (s)",
        "total_input_tokens": "Total input tokens",
        "total_input_tokens_server": "Total input tokens (server usage)",
        "total_output_tokens": "Total generated tokens",
        "request_throughput": "Request throughput (req/s)",
        "input_throughput": "Input token throughput (tok/s)",
        "output_throughput": "Output token throughput (tok/s)",
        "total_throughput": "Total token throughput (tok/s)",
        "concurrency": "Concurrency",
    }
    rows += [_line(label, summary[key]) for key, label in labels.items()]
    kv = {
        "kv_pages_pulled": "KV pages pulled by decode",
        "kv_pages_reused": "KV pages reused by decode (not pulled)",
        "kv_pages_overlapped": "KV pages pulled while prefill ran",
        "kv_bytes_pulled": "KV bytes pulled by decode",
        "kv_pulls": "KV pulls (ranges and final pages)",
        "prefill_tokens_computed": "Prompt tokens computed by prefill",
        "prefix_hit_tokens": "Prompt tokens hit in prefill's prefix cache",
        "host_tier_hit_tokens": "  of which loaded back from its host tier",
        "host_tier_loaded_pages": "Pages loaded back from the host tier",
    }
    rows += [_line(label, int(summary[key])) for key, label in kv.items() if key in summary]
    if "kv_pull_seconds" in summary:
        rows.append(_line("KV pull time, all pulls (s)", summary["kv_pull_seconds"]))
    rows += _latency_lines("TTFT", "ttft", summary)
    rows += _latency_lines("TPOT", "tpot", summary)
    rows += _latency_lines("ITL", "itl", summary)
    rows += _latency_lines("E2E Latency", "e2e_latency", summary)
    rows.append("=" * 54)
    return "\n".join(rows)
