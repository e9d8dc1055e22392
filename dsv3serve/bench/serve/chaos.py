"""``bench serve --chaos``: kill Serve replicas on a schedule during a run, and report
throughput over time, failed and migrated requests, and the time to recover from each kill.

SPEC is a comma-separated list of ``DEPLOYMENT@SECONDS`` (e.g. ``decode-0@10,prefill-0@20``):
at that many seconds after the run starts (after the warm-up), the replica actor of that
deployment of Serve app ``--chaos-app`` is killed (``ray.kill``, ``no_restart``: Serve starts
a new one), through the Ray cluster at ``--ray-address``. Migrations are read from each
router replica's ``/metrics`` (``--metrics-url``, repeated) before and after the run.

Per kill, the report gives ``first_success_s`` (from the kill to the first successful
completion of a request sent after it) and ``output_back_s``: from the kill to the start
of the first one-second bin, after the rate of streamed chunks first fell below half its
mean over the five bins before the kill, that begins three bins in a row at half that mean
or more (cut short by the next kill); 0 when the rate never fell that low before the next
kill, None when it did not come back.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from dsv3serve.bench.serve.client import RequestResult, httpx
from dsv3serve.bench.serve.config import BenchServeError, ChaosEvent
from router.launch import LOOPBACK, use_loopback_ray

BIN_S = 1.0
BASELINE_BINS = 5
RECOVERED_BINS = 3
MIGRATIONS = "dsv3serve:decode_migrations_total"


@dataclass
class Kill:
    """One kill as it happened: when (seconds from the run's start) and which actor."""

    deployment: str
    planned_s: float
    at_s: float
    actor: str


def kill_replica(app: str, deployment: str) -> str:
    """Kill the replica actor of ``app``'s ``deployment``; returns the actor's name."""
    import ray

    for actor in ray.util.list_named_actors(all_namespaces=True):
        if f"{app}#{deployment}#" in actor["name"]:
            ray.kill(ray.get_actor(actor["name"], namespace=actor["namespace"]), no_restart=True)
            return actor["name"]
    raise BenchServeError(f"--chaos: no replica actor of Serve app {app!r}, {deployment!r}")


def loopback_gcs_running() -> bool:
    """Whether a GCS on this machine was started in loopback mode, as ``dsv3serve serve``
    starts its local cluster (``router.launch.init_local_ray``)."""
    import psutil

    for proc in psutil.process_iter(["cmdline"]):
        cmd = proc.info["cmdline"] or []
        if cmd and cmd[0].endswith("gcs_server") and f"--node-ip-address={LOOPBACK}" in cmd:
            return True
    return False


def connect(address: str) -> None:
    """Join the Ray cluster that runs the app (as a driver; it starts nothing).

    ``auto`` finds the local cluster. Ray combines the GCS port it finds with this node's
    routable address, where a loopback cluster (``dsv3serve serve``'s) does not listen, and
    then retries without end; so with such a cluster running, this driver resolves in
    loopback mode too (before ray is imported).
    """
    if address == "auto" and "ray" not in sys.modules and loopback_gcs_running():
        use_loopback_ray()
    import ray

    if not ray.is_initialized():
        ray.init(address=address, logging_level=logging.ERROR, log_to_driver=False)


async def inject(events: tuple[ChaosEvent, ...], app: str, start: float) -> list[Kill]:
    """Kill each event's replica at its time (``start``: the run's ``perf_counter``)."""
    kills = []
    for event in events:
        await asyncio.sleep(max(0.0, event.at_s - (time.perf_counter() - start)))
        actor = await asyncio.to_thread(kill_replica, app, event.deployment)
        kills.append(Kill(event.deployment, event.at_s, time.perf_counter() - start, actor))
    return kills


async def migrations(client: httpx.AsyncClient, urls: Sequence[str]) -> float | None:
    """``decode_migrations_total`` summed over the router replicas' ``/metrics`` at
    ``urls`` (each replica has its own), or None without any."""
    values = []
    for url in urls:
        text = (await client.get(url)).text
        values += [
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith(MIGRATIONS + "{") and 'role="router"' in line
        ]
    return sum(values) if values else None


def chunk_times(r: RequestResult) -> list[float]:
    """When each streamed content chunk of ``r`` arrived (seconds from the run's start)."""
    if not (r.ttft_s and (r.success or r.itl_s)):
        return []
    first = r.start_s + r.ttft_s
    return [first, *(first + t for t in itertools.accumulate(r.itl_s))]


def timeline(results: list[RequestResult], duration_s: float) -> dict[str, list[float]]:
    """Per one-second bin: streamed chunks, successful completions, failures."""
    bins = max(1, math.ceil(duration_s / BIN_S))
    chunks, done, failed = [0.0] * bins, [0.0] * bins, [0.0] * bins

    def at(t: float) -> int:
        return min(bins - 1, max(0, int(t / BIN_S)))

    for r in results:
        for t in chunk_times(r):
            chunks[at(t)] += 1
        (done if r.success else failed)[at(r.start_s + r.e2e_s)] += 1
    start = [i * BIN_S for i in range(bins)]
    return {"bin_start_s": start, "chunks": chunks, "completed": done, "failed": failed}


def output_back_s(
    chunks: list[float], kill_s: float, end_bin: int, baseline: float
) -> float | None:
    """The module docstring's ``output_back_s`` over bins ``[kill's bin, end_bin)``."""
    half, k = baseline / 2, int(kill_s / BIN_S)
    first_low = next((i for i in range(k, end_bin) if chunks[i] < half), None)
    if first_low is None:
        return 0.0
    for i in range(first_low + 1, end_bin):
        if all(c >= half for c in chunks[i : min(i + RECOVERED_BINS, end_bin)]):
            return i * BIN_S - kill_s
    return None


def recovery(
    kill: Kill, end_bin: int, results: list[RequestResult], line: dict[str, list[float]]
) -> dict:
    """``first_success_s`` and ``output_back_s`` of one kill (``end_bin``: where the next
    kill's bin or the timeline ends)."""
    ends = [r.start_s + r.e2e_s for r in results if r.success and r.start_s >= kill.at_s]
    k = int(kill.at_s / BIN_S)
    before = line["chunks"][max(0, k - BASELINE_BINS) : k]
    baseline = sum(before) / len(before) if before else 0.0
    back = output_back_s(line["chunks"], kill.at_s, end_bin, baseline)
    return {
        "deployment": kill.deployment,
        "planned_s": kill.planned_s,
        "killed_at_s": kill.at_s,
        "actor": kill.actor,
        "first_success_s": min(ends) - kill.at_s if ends else None,
        "baseline_chunks_per_s": baseline,
        "output_back_s": back,
    }


def chaos_report(
    results: list[RequestResult],
    duration_s: float,
    kills: list[Kill],
    migrated: float | None,
) -> dict[str, Any]:
    """The ``chaos`` record of a run: kills with recovery times, failures, the timeline."""
    line = timeline(results, duration_s)
    ends = [int(k.at_s / BIN_S) for k in kills[1:]] + [len(line["chunks"])]
    errors: dict[str, int] = {}
    for r in results:
        if not r.success:
            errors[r.error[:200]] = errors.get(r.error[:200], 0) + 1
    return {
        "kills": [recovery(k, end, results, line) for k, end in zip(kills, ends, strict=True)],
        "failed_requests": sum(not r.success for r in results),
        "migrations": migrated,
        "errors": errors,
        "timeline": line,
    }


def format_chaos(report: dict[str, Any]) -> str:
    """The chaos part of the results table."""
    rows = [f"{' Chaos ':=^54}"]
    rows.append(f"{'Failed requests:':<42}{report['failed_requests']:>12}")
    migrated = report["migrations"]
    rows.append(f"{'Migrated streams:':<42}{'n/a' if migrated is None else int(migrated):>12}")
    for kill in report["kills"]:
        rows.append(f"{'-' * 8} {kill['deployment']} killed at {kill['killed_at_s']:.1f} s")
        for key, label in (
            ("first_success_s", "first success"),
            ("output_back_s", "throughput back"),
        ):
            value = kill[key]
            shown = "never" if value is None else f"{value:.2f}"
            rows.append(f"{'  ' + label + ' after (s):':<42}{shown:>12}")
    for message, count in report["errors"].items():
        rows.append(f"  {count} x {message[:90]}")
    rows.append("=" * 54)
    return "\n".join(rows)
