"""Admission across two routers (issue 29 item 5): 600 concurrent streams against the local
PD app (tiny model, CPU, two router replicas of ``max_in_flight`` 256, one prefill and one
decode replica) through ``bench serve``, with Serve's proxy running our middlewares (as
``dsv3serve serve`` starts it) and holding ``router.max_queued_requests`` (``QUEUED``,
or the second argument) while both routers are full. Prints how many requests each
router served and how long a 429 took, by kind: Serve's proxy refusing for full routers
(``rate_limit_exceeded``, "at capacity") or no KV room on decode within
``router.reserve_wait_s``. While the burst holds the whole budget, a probe thread then
sends ``PROBES`` more requests one at a time and times each 429: the refusal of a full
server, apart from the burst's own arrivals (whose last 429s queue behind the admitted
requests the proxy handles first).
Usage: ``.venv/bin/python benchmarks/run_admission_cpu.py OUT_DIR [QUEUED]``."""

from __future__ import annotations

import json
import os
import socket
import statistics
import sys
import threading
import time
from pathlib import Path

import httpx
import ray
from prometheus_client.parser import text_string_to_metric_families
from ray import serve

from dsv3serve.bench.serve.config import BenchServeConfig
from dsv3serve.bench.serve.run import run_bench_serve
from router.api.admission import admission_limit
from router.app import bind_app
from router.config import ServingConfig
from router.launch import load_deploy_file, use_proxy_middleware

APP = "dsv3serve"
STREAMS = 600
QUEUED = 256  # the proxy's queue of the recorded runs; the second argument overrides it
PROBES = 50
PROBE_AFTER_S = 3.0  # the burst holds the budget by then (its streams run for seconds)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def router_answers(url: str, status: str | None = None) -> float:
    """One router's HTTP answers (``dsv3serve:requests_total``), of ``status`` or all."""
    families = text_string_to_metric_families(httpx.get(url, timeout=30).text)
    return sum(
        s.value
        for family in families
        for s in family.samples
        if s.name == "dsv3serve:requests_total"
        and status in (None, s.labels.get("status"))
        and s.labels.get("role") == "router"
    )


def quantile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def rejection_summary(record: dict[str, object]) -> dict[str, object]:
    """Count and time-to-answer (p50, p99, max, seconds) of each kind of 429."""
    errors, e2e = record["errors"], record["e2e_latencies_s"]
    kinds: dict[str, list[float]] = {"capacity": [], "kv_room": [], "other_error": []}
    for error, took in zip(errors, e2e, strict=True):  # type: ignore[call-overload]
        if not error:
            continue
        if "HTTP 429" in error and "capacity" in error:
            kinds["capacity"].append(took)
        elif "HTTP 429" in error:
            kinds["kv_room"].append(took)
        else:
            kinds["other_error"].append(took)
    return {
        kind: {
            "count": len(times),
            "p50_s": quantile(times, 0.5),
            "p99_s": quantile(times, 0.99),
            "max_s": max(times) if times else None,
            "mean_s": statistics.fmean(times) if times else None,
        }
        for kind, times in kinds.items()
    }


def probe_refusals(base_url: str, times: list[float]) -> None:
    """After ``PROBE_AFTER_S``, ``PROBES`` chat requests one at a time; the seconds each
    429 took go to ``times`` (an answer other than 429 is not timed)."""
    time.sleep(PROBE_AFTER_S)
    body = {
        "model": "deepseek-v3-tiny",
        "messages": [{"role": "user", "content": "probe"}],
        "max_tokens": 4,
    }
    with httpx.Client(base_url=base_url, timeout=60) as client:
        for _ in range(PROBES):
            start = time.perf_counter()
            answer = client.post("/v1/chat/completions", json=body)
            if answer.status_code == 429:
                times.append(time.perf_counter() - start)


def probe_summary(times: list[float]) -> dict[str, object]:
    return {
        "sent": PROBES,
        "refused": len(times),
        "p50_s": quantile(times, 0.5),
        "p99_s": quantile(times, 0.99),
        "max_s": max(times) if times else None,
    }


def main(out: Path, queued: int = QUEUED) -> None:
    args = load_deploy_file(Path("deploy/local-pd.yaml"))["applications"][0]["args"]
    metrics_port, http_port = free_port(), free_port()
    args["router"] |= {"metrics_port": metrics_port, "max_queued_requests": queued}
    cfg = ServingConfig.parse(args)
    urls = [f"http://127.0.0.1:{metrics_port + k}/metrics" for k in range(cfg.router.num_replicas)]
    use_proxy_middleware(admission_limit([cfg.router]))  # as `dsv3serve serve` does
    ray.init(num_cpus=8, include_dashboard=False, _node_ip_address="127.0.0.1")
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": http_port})
        serve.run(bind_app(cfg), name=APP, route_prefix="/")
        config = BenchServeConfig(
            base_url=f"http://127.0.0.1:{http_port}",
            num_prompts=STREAMS,
            random_input_len=32,
            random_output_len=32,
            max_concurrency=STREAMS,
            ignore_eos=True,
            seed=1,
            disable_tqdm=True,
            output_file=out / "admission_two_routers_cpu_bench.json",
        )
        before = [(router_answers(u), router_answers(u, "429")) for u in urls]
        probes: list[float] = []
        prober = threading.Thread(target=probe_refusals, args=(config.base_url, probes))
        prober.start()
        (record,) = run_bench_serve(config)
        prober.join()
        after = [(router_answers(u), router_answers(u, "429")) for u in urls]
        answered = [a[0] - b[0] for a, b in zip(after, before, strict=True)]
        refused = [a[1] - b[1] for a, b in zip(after, before, strict=True)]
    finally:
        serve.shutdown()
        ray.shutdown()
    report = {
        "host_cpus": os.cpu_count(),
        "streams": STREAMS,
        "routers": cfg.router.num_replicas,
        "max_in_flight_per_router": cfg.router.max_in_flight,
        "max_queued_requests": cfg.router.max_queued_requests,
        "succeeded": sum(1 for ok in record["success"] if ok),
        "answered_per_router": answered,
        "429_by_router_per_router": refused,
        "rejections": rejection_summary(record),
        "probes_while_full": probe_summary(probes),
    }
    (out / "admission_two_routers_cpu.json").write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main(Path(sys.argv[1]), *(int(a) for a in sys.argv[2:3]))
