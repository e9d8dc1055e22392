"""The CPU run of ``docs/perf/bench_shared_prefix_tiny_cpu.md``: the local PD app (tiny model,
one prefill and one decode replica, shared-memory transfer) on a fresh loopback Ray cluster,
once with decode-side prefix reuse and once without (``decode_prefix_reuse``), each loaded by
``bench serve --dataset-name generated-shared-prefix`` with ``--metrics-url`` (the decode
replica's KV transfer counters). The two settings alternate for ROUNDS rounds (the 2 cores
are shared: alternating spreads other load over both), each run on its own cluster, with the
1-minute load average before and after. Writes ``bench_shared_prefix_tiny_cpu.json`` into
OUT_DIR. Usage: ``.venv/bin/python benchmarks/run_shared_prefix_cpu.py OUT_DIR [ROUNDS]``."""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

import ray
from ray import serve

from dsv3serve.bench.serve.config import BenchServeConfig
from dsv3serve.bench.serve.metrics import jsonable
from dsv3serve.bench.serve.run import run_bench_serve
from router.app import bind_app
from router.config import ServingConfig
from router.launch import load_deploy_file

APP = "dsv3serve"
WORKLOAD = {  # SGLang's generated-shared-prefix, scaled to the tiny model on 2 cores
    "dataset_name": "generated-shared-prefix",
    "gsp_num_groups": 4,
    "gsp_prompts_per_group": 4,
    "gsp_system_prompt_len": 512,
    "gsp_question_len": 32,
    "gsp_output_len": 8,
    "max_concurrency": 2,
    "ignore_eos": True,
    "seed": 1,
    "disable_tqdm": True,
}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def one_run(reuse: bool) -> dict[str, Any]:
    """A fresh cluster and app with ``decode_prefix_reuse=reuse``; the bench's record."""
    args = load_deploy_file(Path("deploy/local-pd.yaml"))["applications"][0]["args"]
    metrics_port, http_port = free_port(), free_port()
    args["router"] |= {"metrics_port": metrics_port}
    cfg = ServingConfig.parse(args | {"decode_prefix_reuse": reuse})
    ray.init(num_cpus=8, include_dashboard=False, _node_ip_address="127.0.0.1")
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": http_port})
        serve.run(bind_app(cfg), name=APP, route_prefix="/")
        config = BenchServeConfig(
            base_url=f"http://127.0.0.1:{http_port}",
            metrics_urls=(f"http://127.0.0.1:{metrics_port}/metrics",),
            **WORKLOAD,
        )
        load_before = os.getloadavg()[0]
        (record,) = run_bench_serve(config)
        load = {"loadavg_1m_before": load_before, "loadavg_1m_after": os.getloadavg()[0]}
    finally:
        serve.shutdown()
        ray.shutdown()
    return record | load | {"decode_prefix_reuse": reuse}


def _row(i: int, run: dict[str, Any]) -> str:
    cells = [
        str(i // 2 + 1),
        "on" if run["decode_prefix_reuse"] else "off",
        f"{run['kv_pages_pulled']:.0f}",
        f"{run['kv_pages_reused']:.0f}",
        f"{run['kv_bytes_pulled'] / 1e6:.2f}",
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
        "| round | decode reuse | KV pages pulled | pages reused (not pulled) | MB pulled "
        "| mean TTFT ms | median TTFT ms | p99 TTFT ms | mean TPOT ms | duration s "
        "| load 1m before / after |"
    )
    rule = "|" + "---:|" * 11
    return "\n".join([head, rule, *(_row(i, r) for i, r in enumerate(runs))])


def main(out: Path, rounds: int) -> None:
    runs = [one_run(reuse) for _ in range(rounds) for reuse in (True, False)]
    meta = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": "2-core CPU VM (24 GiB), shared with other sessions",
        "command": f"python benchmarks/run_shared_prefix_cpu.py docs/perf {rounds}",
        "app": "deploy/local-pd.yaml (tiny, CPU, page_size 16, shm), decode_prefix_reuse on/off",
    }
    path = out / "bench_shared_prefix_tiny_cpu.json"
    path.write_text(json.dumps(jsonable({"meta": meta, "runs": runs}), indent=2))
    print(f"wrote {path}")
    print(table(runs))


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 3)
