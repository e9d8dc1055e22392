"""The CPU run of ``docs/perf/bench_kv_overlap_tiny_cpu.md``: the local PD app (tiny model,
one prefill and one decode replica, shared-memory transfer, chunked prefill of 512 tokens)
on a fresh loopback Ray cluster, once with the KV transfer overlapped with the prefill and
once without (``kv_transfer_overlap``), each loaded by ``bench serve`` with long random
prompts, one request at a time, and ``--metrics-url`` (the decode replica's KV counters).
Beside the bench's record it keeps the router's mean ``dsv3serve:pd_handoff_seconds``
(prefill result to the first decode output: what the overlap shortens). The two settings
alternate for ROUNDS rounds (the 2 cores are shared), each run on its own cluster, with the
1-minute load average before and after. Writes ``bench_kv_overlap_tiny_cpu.json`` into
OUT_DIR. Usage: ``.venv/bin/python benchmarks/run_kv_overlap_cpu.py OUT_DIR [ROUNDS]``."""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import ray
from prometheus_client.parser import text_string_to_metric_families
from ray import serve

from dsv3serve.bench.serve.config import BenchServeConfig
from dsv3serve.bench.serve.metrics import jsonable
from dsv3serve.bench.serve.run import run_bench_serve
from router.app import bind_app
from router.config import ServingConfig
from router.launch import load_deploy_file

APP = "dsv3serve"
CHUNK = 512
WORKLOAD = {  # long prompts, one at a time: TTFT without queueing
    "dataset_name": "random",
    "num_prompts": 8,
    "random_input_len": 3072,
    "random_output_len": 4,
    "max_concurrency": 1,
    "ignore_eos": True,
    "seed": 1,
    "disable_tqdm": True,
}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def handoff_totals(url: str) -> tuple[float, float]:
    """The router's ``pd_handoff_seconds`` histogram: (sum, count)."""
    totals = {"sum": 0.0, "count": 0.0}
    for family in text_string_to_metric_families(httpx.get(url, timeout=10).text):
        for sample in family.samples:
            for key in totals:
                if sample.name == f"dsv3serve:pd_handoff_seconds_{key}":
                    totals[key] += sample.value
    return totals["sum"], totals["count"]


def app_config(overlap: bool, metrics_port: int) -> ServingConfig:
    args = load_deploy_file(Path("deploy/local-pd.yaml"))["applications"][0]["args"]
    args["router"] |= {"metrics_port": metrics_port}
    args["engine"] |= {"chunked_prefill_size": CHUNK}
    return ServingConfig.parse(args | {"kv_transfer_overlap": overlap})


def one_run(overlap: bool) -> dict[str, Any]:
    """A fresh cluster and app with ``kv_transfer_overlap=overlap``; the bench's record."""
    metrics_port, http_port = free_port(), free_port()
    metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
    ray.init(num_cpus=8, include_dashboard=False, _node_ip_address="127.0.0.1")
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": http_port})
        serve.run(bind_app(app_config(overlap, metrics_port)), name=APP, route_prefix="/")
        config = BenchServeConfig(
            base_url=f"http://127.0.0.1:{http_port}", metrics_urls=(metrics_url,), **WORKLOAD
        )
        load_before = os.getloadavg()[0]
        (record,) = run_bench_serve(config)
        total, count = handoff_totals(metrics_url)  # warm-up included (one request)
        load = {"loadavg_1m_before": load_before, "loadavg_1m_after": os.getloadavg()[0]}
    finally:
        serve.shutdown()
        ray.shutdown()
    handoff = {"mean_handoff_ms": 1000 * total / max(count, 1), "handoffs": count}
    return record | load | handoff | {"kv_transfer_overlap": overlap}


def _row(i: int, run: dict[str, Any]) -> str:
    cells = [
        str(i // 2 + 1),
        "on" if run["kv_transfer_overlap"] else "off",
        f"{run['kv_pages_pulled']:.0f}",
        f"{run['kv_pages_overlapped']:.0f}",
        f"{run['mean_handoff_ms']:.1f}",
        f"{run['mean_ttft_ms']:.0f}",
        f"{run['median_ttft_ms']:.0f}",
        f"{run['p99_ttft_ms']:.0f}",
        f"{run['mean_tpot_ms']:.0f}",
        f"{run['duration_s']:.2f}",
        f"{run['loadavg_1m_before']:.1f} / {run['loadavg_1m_after']:.1f}",
    ]
    return "| " + " | ".join(cells) + " |"


def table(runs: list[dict[str, Any]]) -> str:
    """The markdown table of every run, in the order they ran."""
    head = (
        "| round | overlap | KV pages pulled | pulled while prefill ran | mean handoff ms "
        "| mean TTFT ms | median TTFT ms | p99 TTFT ms | mean TPOT ms | duration s "
        "| load 1m before / after |"
    )
    rule = "|" + "---:|" * 11
    return "\n".join([head, rule, *(_row(i, r) for i, r in enumerate(runs))])


def main(out: Path, rounds: int) -> None:
    runs = [one_run(overlap) for _ in range(rounds) for overlap in (True, False)]
    meta = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": "2-core CPU VM, shared with other sessions",
        "command": f"python benchmarks/run_kv_overlap_cpu.py docs/perf {rounds}",
        "app": f"deploy/local-pd.yaml (tiny, CPU, page_size 16, shm), chunked_prefill_size "
        f"{CHUNK}, kv_transfer_overlap on/off",
    }
    path = out / "bench_kv_overlap_tiny_cpu.json"
    path.write_text(json.dumps(jsonable({"meta": meta, "runs": runs}), indent=2))
    print(f"wrote {path}")
    print(table(runs))


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 3)
