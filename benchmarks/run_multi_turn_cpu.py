"""The CPU run of ``docs/perf/bench_multi_turn_tiny_cpu.md``: the local PD app (tiny model,
one prefill and one decode replica, shared-memory transfer) with a KV pool of 1024 tokens
per replica, once with the hierarchical cache (``enable_hierarchical_cache``, host tier 4x
the pool) and once without, each loaded by ``bench serve --dataset-name multi-turn`` with
``--metrics-url`` (prefill tokens computed, host-tier hits, decode KV pages). The two
settings alternate for ROUNDS rounds, each on a fresh loopback Ray cluster, with the
1-minute load average before and after. Writes ``bench_multi_turn_tiny_cpu.json`` into
OUT_DIR. Usage: ``.venv/bin/python benchmarks/run_multi_turn_cpu.py OUT_DIR [ROUNDS]``."""

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
POOL_TOKENS = 1024  # 64 pages of 16: one round's fillers (6 x 256 tokens) overflow it
WORKLOAD = {
    "dataset_name": "multi-turn",
    "mt_num_conversations": 4,
    "mt_num_turns": 3,
    "mt_turn_len": 128,
    "mt_num_fillers": 6,
    "mt_filler_len": 256,
    "mt_output_len": 8,
    "max_concurrency": 2,
    "ignore_eos": True,
    "seed": 1,
    "disable_tqdm": True,
}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def one_run(tier: bool) -> dict[str, Any]:
    """A fresh cluster and app, with or without the host tier; the bench's record."""
    args = load_deploy_file(Path("deploy/local-pd.yaml"))["applications"][0]["args"]
    metrics_port, http_port = free_port(), free_port()
    args["router"] |= {"metrics_port": metrics_port}
    args["engine"] |= {"num_kv_tokens": POOL_TOKENS}
    if tier:
        args["engine"] |= {"enable_hierarchical_cache": True, "hicache_ratio": 4.0}
    cfg = ServingConfig.parse(args)
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
    return record | load | {"hierarchical_cache": tier}


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def _row(i: int, run: dict[str, Any]) -> str:
    cells = [
        str(i // 2 + 1),
        "on" if run["hierarchical_cache"] else "off",
        f"{run['prefill_tokens_computed']:.0f}",
        f"{run['prefix_hit_tokens']:.0f}",
        f"{run['host_tier_hit_tokens']:.0f}",
        f"{run['kv_pages_reused']:.0f}",
        _ms(run["revisit_mean_ttft_ms"]),
        _ms(run["first_turn_mean_ttft_ms"]),
        _ms(run["filler_mean_ttft_ms"]),
        f"{run['mean_ttft_ms']:.0f}",
        f"{run['duration_s']:.2f}",
        f"{run['loadavg_1m_before']:.1f} / {run['loadavg_1m_after']:.1f}",
    ]
    return "| " + " | ".join(cells) + " |"


def table(runs: list[dict[str, Any]]) -> str:
    """The markdown table of every run, in the order they ran."""
    head = (
        "| round | host tier | prefill tokens computed | prefill prefix hits | of which "
        "host tier | decode pages reused | revisit mean TTFT ms | first-turn mean TTFT ms "
        "| filler mean TTFT ms | all mean TTFT ms | duration s | load 1m before / after |"
    )
    rule = "|" + "---:|" * 12
    return "\n".join([head, rule, *(_row(i, r) for i, r in enumerate(runs))])


def main(out: Path, rounds: int) -> None:
    runs = [one_run(tier) for _ in range(rounds) for tier in (True, False)]
    meta = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": "2-core CPU dev VM, shared with other sessions",
        "command": f"python benchmarks/run_multi_turn_cpu.py docs/perf {rounds}",
        "app": f"deploy/local-pd.yaml with num_kv_tokens {POOL_TOKENS}, hierarchical cache "
        "(hicache_ratio 4) on / off",
    }
    path = out / "bench_multi_turn_tiny_cpu.json"
    path.write_text(json.dumps(jsonable({"meta": meta, "runs": runs}), indent=2))
    print(f"wrote {path}")
    print(table(runs))


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 2)
