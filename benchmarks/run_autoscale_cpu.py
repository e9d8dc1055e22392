"""The CPU ramp of ``docs/perf/autoscale_tiny_cpu.md``: the same low -> high -> low load from
``bench serve`` against a fixed 1 + 1 PD app, then against the SLO-autoscaled app
(prefill and decode 1..2 replicas), one after the other on one fresh loopback Ray cluster,
sampling each role's running replicas every second. Writes ``autoscale_tiny_cpu.json`` and
``autoscale_tiny_cpu.png`` (replicas over time) to OUT_DIR and prints a table.
Usage: ``PYTHONPATH=. .venv/bin/python benchmarks/run_autoscale_cpu.py OUT_DIR
[--num-cpus N] [--high-rate R --high-prompts N]`` (the CPUs Ray's cluster offers; 8 by
default, as on the 2-core VM the first record was made on: each worker replica asks for
0.5; the high phase's request rate and length, 10 req/s x 100 by default: a bigger host
needs more to load one replica of each role past the targets). The JSON records the
host's ``os.cpu_count()`` and the phases it ran."""

from __future__ import annotations

import argparse
import json
import os
import socket
import threading
import time
from pathlib import Path
from typing import Any

import ray
from ray import serve

from dsv3serve.bench.serve.config import BenchServeConfig
from dsv3serve.bench.serve.run import run_bench_serve
from router.app import bind_app
from router.config import ServingConfig
from router.launch import deploy_autoscaled, use_proxy_middleware

ENGINE = {"model": "tiny", "device": "cpu", "page_size": 16, "num_kv_tokens": 16384}
ENGINE |= {"fp8_act_quant": False}
SLO = {"ttft_p99_s": 0.8, "itl_p99_s": 0.3, "cooldown_s": 5.0}
SLO |= {"metrics_interval_s": 1.0, "look_back_period_s": 5.0, "drain_timeout_s": 120.0}
Phase = tuple[str, float, int]  # name, req/s, prompts


def phases(high_rate: float = 10.0, high_prompts: int = 100) -> tuple[Phase, ...]:
    """Low, high, low: the ramp."""
    return (("low", 0.5, 8), ("high", high_rate, high_prompts), ("low", 0.5, 16))


BOUNDS = {"num_replicas": 1, "min_replicas": 1, "max_replicas": 2}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def app_args(autoscaled: bool) -> dict[str, Any]:
    role = {"num_cpus": 0.5} | (BOUNDS if autoscaled else {"num_replicas": 1})
    args: dict[str, Any] = {"mode": "pd", "engine": ENGINE, "prefill": role, "decode": role}
    args |= {"torch_threads": 1, "router": {"served_model_name": "tiny", "num_replicas": 1}}
    return args | ({"slo": SLO} if autoscaled else {})


class ReplicaSampler:
    """Every second: seconds since start, and each role's RUNNING worker replicas."""

    def __init__(self, app: str) -> None:
        self.app = app
        self.samples: list[dict[str, float]] = []
        self.stop = threading.Event()
        self.start = time.monotonic()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.stop.wait(1.0):
            status = serve.status().applications.get(self.app)
            if status is None:
                continue
            count = {"t": time.monotonic() - self.start, "prefill": 0.0, "decode": 0.0}
            for name, dep in status.deployments.items():
                role = name.split("-")[0]
                if role in ("prefill", "decode"):
                    count[role] += dep.replica_states.get("RUNNING", 0)
            self.samples.append(count)


def ramp(url: str, label: str, plan: tuple[Phase, ...]) -> list[dict[str, Any]]:
    """The phases of ``plan`` against ``url``; one summary per phase (with its start
    time)."""
    summaries = []
    for i, (name, rate, prompts) in enumerate(plan):
        config = BenchServeConfig(
            base_url=url,
            num_prompts=prompts,
            random_input_len=384,
            random_output_len=32,
            request_rate=rate,
            ignore_eos=True,
            seed=i + 1,
            warmup_requests=1 if i == 0 else 0,
            disable_tqdm=True,
        )
        started = time.monotonic()
        (record,) = run_bench_serve(config)
        keep = ("completed", "failed", "duration_s", "p99_ttft_ms", "median_ttft_ms")
        keep += ("p99_itl_ms", "median_itl_ms", "request_throughput")
        summaries.append({"app": label, "phase": name, "rate": rate, "t0": started})
        summaries[-1] |= {k: record.get(k) for k in keep}
    return summaries


def run_app(base: str, name: str, autoscaled: bool, plan: tuple[Phase, ...]) -> dict[str, Any]:
    args = app_args(autoscaled)
    entry = {"name": name, "route_prefix": f"/{name}", "import_path": "router.app:build_app"}
    if autoscaled:
        deploy_autoscaled([entry | {"args": args}])
    else:
        serve.run(bind_app(ServingConfig.parse(args)), name=name, route_prefix=f"/{name}")
    sampler = ReplicaSampler(name)
    sampler.thread.start()
    try:
        summaries = ramp(f"{base}/{name}", name, plan)
    finally:
        sampler.stop.set()
        sampler.thread.join()
        serve.delete(name)
    for phase in summaries:
        phase["t0"] -= sampler.start
    return {"phases": summaries, "replicas": sampler.samples}


def plot(runs: dict[str, dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(8, 2.8), sharey=True, dpi=80)
    for ax, (label, run) in zip(axes, runs.items(), strict=True):
        t = [s["t"] for s in run["replicas"]]
        for role, shift, style in (("prefill", 0.03, "-"), ("decode", -0.03, "--")):
            counts = [s[role] + shift for s in run["replicas"]]  # shifted apart to be seen
            ax.step(t, counts, where="post", linestyle=style, label=role)
        for phase in run["phases"]:
            ax.axvline(phase["t0"], color="grey", lw=0.5)
            ax.text(phase["t0"], 2.15, phase["phase"], fontsize=7)
        ax.set(title=label, xlabel="s", ylim=(0, 2.4))
    axes[0].set_ylabel("running replicas")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)


def main(out: Path, num_cpus: int = 8, plan: tuple[Phase, ...] = phases()) -> None:
    use_proxy_middleware()
    port = free_port()
    ray.init(num_cpus=num_cpus, include_dashboard=False, _node_ip_address="127.0.0.1")
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        base = f"http://127.0.0.1:{port}"
        runs = {
            "fixed": run_app(base, "fixed", False, plan),
            "scaled": run_app(base, "scaled", True, plan),
        }
    finally:
        serve.shutdown()
        ray.shutdown()
    host = {"cpu_count": os.cpu_count(), "ray_num_cpus": num_cpus}
    body = {"host": host, "slo": SLO, "bounds": BOUNDS, "phases": plan, "runs": runs}
    (out / "autoscale_tiny_cpu.json").write_text(json.dumps(body, indent=2))
    plot(runs, out / "autoscale_tiny_cpu.png")
    print(
        f"{'app':8}{'phase':6}{'req/s':>6}{'ok':>4}{'fail':>5}{'p99 TTFT ms':>12}{'p99 ITL ms':>11}"
    )
    for run in runs.values():
        for p in run["phases"]:
            print(
                f"{p['app']:8}{p['phase']:6}{p['rate']:>6}{p['completed']:>4}{p['failed']:>5}"
                f"{p['p99_ttft_ms']:>12.0f}{p['p99_itl_ms']:>11.0f}"
            )


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="SLO autoscaling ramp, tiny model, CPU")
    parser.add_argument("out", type=Path, help="folder for the JSON and the plot")
    parser.add_argument("--num-cpus", type=int, default=8, help="CPUs Ray's cluster offers")
    parser.add_argument("--high-rate", type=float, default=10.0, help="high phase's req/s")
    parser.add_argument("--high-prompts", type=int, default=100, help="high phase's requests")
    return parser.parse_args()


if __name__ == "__main__":
    args = parse_args()
    main(args.out, args.num_cpus, phases(args.high_rate, args.high_prompts))
