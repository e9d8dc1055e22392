"""Print docs/perf/serve_gpu.md's tables from a benchmarks/serve_gpu.py record (JSON).

python3 benchmarks/serve_gpu_report.py docs/perf/serve_gpu_2xh200.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any


def _f(value: Any, digits: int = 1) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def start_table(rec: dict[str, Any]) -> list[str]:
    rows = ["| start | time from `dsv3serve serve` to the first answer (s) |", "|---|---|"]
    for stage in ("cold", "warm"):
        part = rec.get(stage, {})
        rows.append(f"| {stage} | {part.get('time_to_first_answer_s', part.get('error', '-'))} |")
    return rows


def greedy_table(rec: dict[str, Any]) -> list[str]:
    eng = rec.get("engine", {})
    rows = [
        "| HTTP path | verdict | matching tokens | same-input logprob gap | engine spread |",
        "|---|---|---|---|---|",
    ]
    for kind in ("sequential", "whole", "stream"):
        c = eng.get(f"http_{kind}")
        if c:
            rows.append(
                f"| {kind} | {c['verdict']} | {c['matching_tokens']}/{c['reference_tokens']} "
                f"| {c['same_input_logprob_gap']} | {_f(eng.get('engine_spread'), 4)} |"
            )
    return rows


def engine_rows(rec: dict[str, Any]) -> dict[int, dict[str, Any]]:
    return {r["batch_size"]: r for r in rec.get("engine", {}).get("one_batch", [])}


def bench_table(rec: dict[str, Any]) -> list[str]:
    eng = engine_rows(rec)
    rows = [
        "| concurrency | ok / failed | output tok/s | per GPU | TTFT p50 / p99 (ms) "
        "| ITL p50 / p99 (ms) | KV per request (MB, ms) | engine step at batch (ms) "
        "| engine decode tok/s | app / engine tok/s | ITL p50 / engine step |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    bench = {c: r for c, r in rec.get("bench", {}).items() if c.isdigit()}
    for c, r in sorted(bench.items(), key=lambda kv: int(kv[0])):
        if not isinstance(r, dict) or "completed" not in r:
            rows.append(f"| {c} | {r} |")
            continue
        e = eng.get(int(c), {})
        step_ms = 1e3 * e["median_decode_latency_s"] if e else None
        tok_s = e.get("median_decode_throughput_tok_s")
        rows.append(
            f"| {c} | {r['completed']} / {r['failed']} | {_f(r['output_throughput'])} "
            f"| {_f(r['output_tok_s_per_gpu'])} "
            f"| {_f(r['median_ttft_ms'])} / {_f(r['p99_ttft_ms'])} "
            f"| {_f(r['median_itl_ms'], 2)} / {_f(r['p99_itl_ms'], 2)} "
            f"| {_f(r['kv_bytes_per_request'] / 1e6, 2)}, {_f(r['kv_pull_ms_per_request'], 2)} "
            f"| {_f(step_ms, 2)} | {_f(tok_s)} "
            f"| {_f(r['output_throughput'] / tok_s if tok_s else None, 2)} "
            f"| {_f(r['median_itl_ms'] / step_ms if step_ms else None, 2)} |"
        )
    return rows


def chaos_lines(rec: dict[str, Any]) -> list[str]:
    chaos = rec.get("chaos", {})
    report = chaos.get("chaos") or {}
    kills = report.get("kills", [])
    lines = [
        f"- load: concurrency {chaos.get('max_concurrency')}, kill {chaos.get('kill')}; "
        f"completed {chaos.get('completed')}, failed {chaos.get('failed')}, "
        f"migrations {report.get('migrations')}"
    ]
    for k in kills:
        lines.append(
            f"- {k.get('deployment')} killed at {_f(k.get('killed_at_s'))} s: first success "
            f"after {_f(k.get('first_success_s'))} s, output back after "
            f"{_f(k.get('output_back_s'))} s"
        )
    return lines


def main(path: str) -> None:
    rec = json.loads(Path(path).read_text())
    for title, lines in (
        ("Start", start_table(rec)),
        ("Greedy text, HTTP vs the offline engine", greedy_table(rec)),
        ("bench serve vs the engine", bench_table(rec)),
        ("Decode kill under load", chaos_lines(rec)),
    ):
        print(f"### {title}\n")
        print("\n".join(lines) + "\n")


if __name__ == "__main__":
    main(sys.argv[1])
