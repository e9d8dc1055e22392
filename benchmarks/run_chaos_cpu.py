"""The CPU chaos run of ``docs/perf/chaos_tiny_cpu.md``: the local PD app (tiny model, two
router replicas, one prefill and one decode replica) on a fresh loopback Ray cluster with
Serve's proxy running our middleware (as ``dsv3serve serve`` sets it up), then ``bench serve
--chaos`` against it, killing the decode replica, the prefill replica and a router replica.
Usage: ``.venv/bin/python benchmarks/run_chaos_cpu.py OUT_DIR``."""

from __future__ import annotations

import socket
import sys
from pathlib import Path

import ray
from ray import serve

from dsv3serve.bench.serve.config import BenchServeConfig, parse_chaos
from dsv3serve.bench.serve.run import run_bench_serve
from router.app import bind_app
from router.config import ServingConfig
from router.launch import load_deploy_file, use_proxy_middleware

APP = "dsv3serve"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def main(out: Path) -> None:
    args = load_deploy_file(Path("deploy/local-pd.yaml"))["applications"][0]["args"]
    metrics_port, http_port = free_port(), free_port()
    args["router"] |= {"metrics_port": metrics_port}
    cfg = ServingConfig.parse(args)
    use_proxy_middleware()  # before Ray starts: the proxy reads it when it starts
    ray.init(num_cpus=8, include_dashboard=False, _node_ip_address="127.0.0.1")
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": http_port})
        serve.run(bind_app(cfg), name=APP, route_prefix="/")
        config = BenchServeConfig(
            base_url=f"http://127.0.0.1:{http_port}",
            num_prompts=80,
            random_input_len=128,
            random_output_len=64,
            request_rate=2.0,
            max_concurrency=16,
            ignore_eos=True,
            seed=1,
            disable_tqdm=True,
            chaos=parse_chaos("decode-0@10,prefill-0@25,router@35"),
            chaos_app=APP,
            metrics_urls=tuple(
                f"http://127.0.0.1:{metrics_port + k}/metrics"
                for k in range(cfg.router.num_replicas)  # router replica k: metrics_port + k
            ),
            output_file=out / "chaos_tiny_cpu.json",
            plot=out / "chaos_tiny_cpu.png",
        )
        run_bench_serve(config)
    finally:
        serve.shutdown()
        ray.shutdown()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
