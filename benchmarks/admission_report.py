"""Bench-only, for ``run_admission_cpu.py``: the burst's refusals by kind, and where each
request's time went, from the client processes' stamps (``admission_clients.py``) and
the proxy's (``admission_stamps.py``), all wall-clock seconds on one host.

The steps of one request: ``start`` (the burst's shared start instant) -> ``task_start``
(its task in the client began) -> ``sent`` (its head written to the socket) ->
``arrived`` (it entered the proxy's middlewares, where the door is) -> ``head_sent``
(the proxy handed its response head to uvicorn) -> ``head`` (the client had the head).
"""

from __future__ import annotations

import statistics

Record = dict[str, object]

# (name, from step, to step) of each part of a request's time
STEPS = (
    ("start_to_task", "start", "task_start"),
    ("client_send_lag", "task_start", "sent"),
    ("connect", "connect_start", "connect_done"),
    ("proxy_arrival_lag", "sent", "arrived"),
    ("in_proxy", "arrived", "head_sent"),
    ("proxy_to_client", "head_sent", "head"),
    ("door_to_client", "arrived", "head"),
    ("from_own_send", "sent", "head"),
    ("from_task_start", "task_start", "head"),
)


def quantile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def stats(values: list[float]) -> dict[str, object]:
    """Count, p50, p99, max and mean (seconds), None where there are no values."""
    return {
        "count": len(values),
        "p50_s": quantile(values, 0.5),
        "p99_s": quantile(values, 0.99),
        "max_s": max(values) if values else None,
        "mean_s": statistics.fmean(values) if values else None,
    }


def kind_of(record: Record) -> str:
    """``ok``, ``capacity`` (429 at capacity: the door's or Serve's proxy's), ``kv_room``
    (429 with no decode KV room) or ``other_error``."""
    error = str(record.get("error") or "")
    if record.get("success"):
        return "ok"
    if "HTTP 429" in error:
        return "capacity" if "capacity" in error else "kv_room"
    return "other_error"


def rejection_summary(records: list[Record]) -> dict[str, object]:
    """Each kind of failure: count and seconds from the request's task start to the end
    of its answer (``bench serve``'s E2E of a failed request)."""
    kinds: dict[str, list[float]] = {"capacity": [], "kv_room": [], "other_error": []}
    for record in records:
        kind = kind_of(record)
        if kind != "ok" and record.get("done") is not None:
            kinds[kind].append(float(record["done"]) - float(record["task_start"]))  # type: ignore[arg-type]
    return {kind: stats(times) for kind, times in kinds.items()}


def merged(records: list[Record], door: list[Record], start: float) -> list[Record]:
    """Each client record with the proxy's stamps of the same id and the shared start."""
    by_id = {str(d["id"]): d for d in door}
    out = []
    for record in records:
        stamp = by_id.get(str(record["id"]), {})
        out.append(record | {"start": start} | {k: stamp.get(k) for k in ("arrived", "head_sent")})
    return out


def step_times(records: list[Record]) -> dict[str, dict[str, object]]:
    """Each part of :data:`STEPS` over ``records`` (those with both ends stamped)."""
    out = {}
    for name, first, last in STEPS:
        values = [
            float(r[last]) - float(r[first])  # type: ignore[arg-type]
            for r in records
            if r.get(first) is not None and r.get(last) is not None
        ]
        out[name] = stats(values)
    return out


def decomposition(full: list[Record]) -> dict[str, object]:
    """The parts of :data:`STEPS` for the refusals at capacity and for the admitted, and
    the spreads of the burst: when the last task began, the last request was sent, and
    the last entered the proxy, seconds after the start."""

    def last(step: str) -> float | None:
        times = [float(r[step]) - float(r["start"]) for r in full if r.get(step) is not None]  # type: ignore[arg-type]
        return max(times) if times else None

    return {
        "refused_at_capacity": step_times([r for r in full if kind_of(r) == "capacity"]),
        "admitted": step_times([r for r in full if kind_of(r) == "ok"]),
        "last_task_start_s": last("task_start"),
        "last_sent_s": last("sent"),
        "last_arrived_s": last("arrived"),
        "stamped_in_proxy": sum(1 for r in full if r.get("arrived") is not None),
        "refused_were_the_last_arrivals": refused_last(full),
    }


def refused_last(full: list[Record]) -> bool:
    """Whether the refusals at capacity were exactly the last requests into the proxy."""
    stamped = sorted((r for r in full if r.get("arrived") is not None), key=lambda r: r["arrived"])  # type: ignore[arg-type, return-value]
    refused = [kind_of(r) == "capacity" for r in stamped]
    return refused == sorted(refused)


def loop_lateness(door: dict[str, object], start: float, until_s: float) -> dict[str, object]:
    """The proxy's event loop in the first ``until_s`` seconds after ``start``: how many
    of its ticks were late (> 2 ms), the latest, and their summed lateness."""
    late = [
        float(lag)
        for at, lag in door.get("loop_late_ticks") or []  # type: ignore[union-attr]
        if 0 <= float(at) - start <= until_s
    ]
    return {
        "window_s": until_s,
        "late_ticks": len(late),
        "max_late_s": max(late) if late else 0.0,
        "sum_late_s": sum(late),
    }


def ms(value: object) -> str:
    return "-" if value is None else f"{float(value) * 1000:.1f}"  # type: ignore[arg-type]


def format_summary(report: dict[str, object]) -> str:
    """A run's summary (``admission_two_routers_cpu.json``) as a short table, in ms."""
    lines = [
        f"streams {report['streams']} from {report['client_processes']} client process(es),"
        f" budget {report['admission_budget']}: {report['succeeded']} answered 200,"
        f" per router {report['answered_per_router']}"
    ]
    for kind, s in report["rejections"].items():  # type: ignore[attr-defined]
        lines.append(f"429 {kind}: {s['count']}, p50 {ms(s['p50_s'])} / p99 {ms(s['p99_s'])} ms")
    lines.append(
        f"{'part':18s} {'refused: p50 / p99 / max ms':>30s} {'admitted: p50 / p99 ms':>24s}"
    )
    parts = report["decomposition"]  # type: ignore[index]
    for name, _, _ in STEPS:
        r, a = parts["refused_at_capacity"][name], parts["admitted"][name]  # type: ignore[index]
        refused = f"{ms(r['p50_s'])} / {ms(r['p99_s'])} / {ms(r['max_s'])}"
        lines.append(f"{name:18s} {refused:>30s} {ms(a['p50_s']) + ' / ' + ms(a['p99_s']):>24s}")
    spreads = {k: ms(v) for k, v in parts.items() if k.startswith("last_")}  # type: ignore[attr-defined]
    lines.append(f"ms after the start: {spreads}")
    lines.append(f"proxy loop: {report.get('proxy_loop_during_arrivals')}")
    lines.append(f"probes while full: {report['probes_while_full']}")
    return "\n".join(lines)


if __name__ == "__main__":
    import json
    import sys
    from pathlib import Path

    print(format_summary(json.loads(Path(sys.argv[1]).read_text())))
