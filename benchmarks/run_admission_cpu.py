"""Admission across two routers (issue 29 item 5): a burst of concurrent streams (600 by
default) against the local PD app (tiny model, CPU, two router replicas of
``max_in_flight`` 256 unless ``--max-in-flight``, one prefill and one decode replica),
with Serve's proxy running our middlewares (as ``dsv3serve serve`` starts it, the door's
budget included) and holding ``router.max_queued_requests`` (``QUEUED``, the second
argument) behind them.

The burst comes from ``--clients`` processes (``admission_clients.py``: ``bench serve``'s
own loop, one asyncio loop and one httpx client each), released at one wall-clock
instant, each with every ``clients``-th request; 1 (the default) is one client process
sending the whole burst, as the earlier records did. The proxy stamps each request of the
burst as it enters its middlewares (``admission_stamps.py``, bench-only), so the record
splits each request's time into the client's send lag, the proxy's arrival lag (sent ->
door) and door -> client (``admission_report.py``).

Prints and writes (``OUT_DIR/admission_two_routers_cpu.json``) how many requests each
router answered, the 429s by kind (at capacity: the door's or Serve's proxy's; no KV room
on decode within ``router.reserve_wait_s``), that decomposition and how late the proxy's
event loop ran. While the burst holds the whole budget, a probe thread then sends
``--probes`` requests one at a time and times each 429: the refusal of a full server.
``OUT_DIR/admission_requests.json`` holds every request's stamps.
Usage: ``.venv/bin/python benchmarks/run_admission_cpu.py OUT_DIR [QUEUED] [--clients N]
[--streams N] [--max-in-flight N] [--probes N]``."""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import ray
from admission_report import decomposition, loop_lateness, merged, rejection_summary, stats
from admission_stamps import CALLBACK, STAMPS_PATH
from prometheus_client.parser import text_string_to_metric_families
from ray import serve

from router.api.admission import admission_limit
from router.api.proxy_middleware import PROXY_CALLBACK_ENV
from router.app import bind_app
from router.config import ServingConfig
from router.launch import load_deploy_file, use_proxy_middleware

APP = "dsv3serve"
HERE = Path(__file__).resolve().parent
CLIENT_SCRIPT = HERE / "admission_clients.py"
RELEASE_AFTER_S = 0.5  # from the last client's "ready" to the shared start instant


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path)
    p.add_argument("queued", type=int, nargs="?", default=256, help="max_queued_requests")
    p.add_argument("--streams", type=int, default=600)
    p.add_argument("--clients", type=int, default=1, help="client processes")
    p.add_argument("--max-in-flight", type=int, default=None, help="per router")
    p.add_argument("--probes", type=int, default=50)
    p.add_argument("--probe-after", type=float, default=3.0, help="s after the start")
    p.add_argument("--num-cpus", type=int, default=8, help="Ray's logical CPUs")
    args = p.parse_args(argv)
    if not 1 <= args.clients <= args.streams:
        p.error(f"--clients: expected 1..{args.streams}, got {args.clients}")
    return args


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def router_answers(url: str, status: str | None = None) -> float:
    """One router's HTTP answers (``dsv3serve:requests_total``), of ``status`` or all
    (its metrics server may still be starting: asked again for up to a minute)."""
    for _ in range(60):
        try:
            text = httpx.get(url, timeout=30).text
            break
        except httpx.ConnectError:
            time.sleep(1)
    else:
        raise RuntimeError(f"no router metrics at {url} within a minute")
    families = text_string_to_metric_families(text)
    return sum(
        s.value
        for family in families
        for s in family.samples
        if s.name == "dsv3serve:requests_total"
        and status in (None, s.labels.get("status"))
        and s.labels.get("role") == "router"
    )


def chat_body(content: str, max_tokens: int) -> dict[str, object]:
    return {
        "model": "deepseek-v3-tiny",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
    }


def probe_refusals(base_url: str, at: float, count: int, times: list[float]) -> None:
    """At wall time ``at``, ``count`` chat requests one at a time; the seconds each 429
    took go to ``times`` (an answer other than 429 is not timed)."""
    time.sleep(max(0.0, at - time.time()))
    with httpx.Client(base_url=base_url, timeout=60) as client:
        for _ in range(count):
            begun = time.perf_counter()
            answer = client.post("/v1/chat/completions", json=chat_body("probe", 4))
            if answer.status_code == 429:
                times.append(time.perf_counter() - begun)


def start_clients(args: argparse.Namespace, base_url: str) -> list[subprocess.Popen[str]]:
    """One ``admission_clients.py`` process per client, each loading its share."""
    procs = []
    for k in range(args.clients):
        spec = {
            "base_url": base_url,
            "model": "deepseek-v3-tiny",
            "streams": args.streams,
            "clients": args.clients,
            "client": k,
            "input_len": 32,
            "output_len": 32,
            "seed": 1,
            "out": str(args.out / f"client_{k}.json"),
        }
        command = [sys.executable, str(CLIENT_SCRIPT), json.dumps(spec)]
        procs.append(
            subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        )
    return procs


def release(procs: list[subprocess.Popen[str]]) -> float:
    """Wait until every client is ready; give them all one start instant, returned."""
    for proc in procs:
        line = proc.stdout.readline() if proc.stdout else ""
        if line.strip() != "ready":
            raise RuntimeError(f"an admission client did not start (said {line!r})")
    start = time.time() + RELEASE_AFTER_S
    for proc in procs:
        assert proc.stdin is not None
        proc.stdin.write(f"{start!r}\n")
        proc.stdin.close()
    print(f"the burst starts at {start:.3f} (wall clock)", flush=True)
    return start


def collect(procs: list[subprocess.Popen[str]], out: Path) -> list[dict[str, object]]:
    records: list[dict[str, object]] = []
    for k, proc in enumerate(procs):
        if proc.wait() != 0:
            raise RuntimeError(f"admission client {k} failed (exit {proc.returncode})")
        path = out / f"client_{k}.json"
        records += json.loads(path.read_text())
        path.unlink()
    return sorted(records, key=lambda r: r["index"])  # type: ignore[arg-type, return-value]


def stamped_proxy() -> None:
    """Serve's proxy runs our middlewares inside ``admission_stamps``'s stamps; call after
    ``use_proxy_middleware`` and before ``ray.init`` (the proxy inherits the environment)."""
    os.environ[PROXY_CALLBACK_ENV] = CALLBACK
    os.environ["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(HERE), os.environ.get("PYTHONPATH")])
    )


def main(args: argparse.Namespace) -> None:
    args.out.mkdir(parents=True, exist_ok=True)
    deploy = load_deploy_file(HERE.parent / "deploy/local-pd.yaml")["applications"][0]["args"]
    metrics_port, http_port = free_port(), free_port()
    overrides = {"metrics_port": metrics_port, "max_queued_requests": args.queued}
    if args.max_in_flight is not None:
        overrides["max_in_flight"] = args.max_in_flight
    deploy["router"] |= overrides
    cfg = ServingConfig.parse(deploy)
    urls = [f"http://127.0.0.1:{metrics_port + k}/metrics" for k in range(cfg.router.num_replicas)]
    use_proxy_middleware(admission_limit([cfg.router]))  # as `dsv3serve serve` does
    stamped_proxy()
    base_url = f"http://127.0.0.1:{http_port}"
    ray.init(num_cpus=args.num_cpus, include_dashboard=False, _node_ip_address="127.0.0.1")
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": http_port})
        serve.run(bind_app(cfg), name=APP, route_prefix="/")
        httpx.post(f"{base_url}/v1/chat/completions", json=chat_body("warm up", 4), timeout=300)
        before = [(router_answers(u), router_answers(u, "429")) for u in urls]
        procs = start_clients(args, base_url)
        start = release(procs)
        probes: list[float] = []
        probe_at = start + args.probe_after
        prober = threading.Thread(
            target=probe_refusals, args=(base_url, probe_at, args.probes, probes)
        )
        prober.start()
        records = collect(procs, args.out)
        prober.join()
        after = [(router_answers(u), router_answers(u, "429")) for u in urls]
        door = httpx.get(base_url + STAMPS_PATH, timeout=60).json()
    finally:
        serve.shutdown()
        ray.shutdown()
    full = merged(records, door["requests"], start)
    last_in = max((float(r["arrived"]) for r in full if r.get("arrived")), default=start)
    report = {
        "host_cpus": os.cpu_count(),
        "streams": args.streams,
        "client_processes": args.clients,
        "routers": cfg.router.num_replicas,
        "max_in_flight_per_router": cfg.router.max_in_flight,
        "max_queued_requests": cfg.router.max_queued_requests,
        "admission_budget": admission_limit([cfg.router]),
        "succeeded": sum(1 for r in records if r["success"]),
        "answered_per_router": [a[0] - b[0] for a, b in zip(after, before, strict=True)],
        "429_by_router_per_router": [a[1] - b[1] for a, b in zip(after, before, strict=True)],
        "rejections": rejection_summary(records),
        "decomposition": decomposition(full),
        "proxy_loop_during_arrivals": loop_lateness(door, start, last_in - start + 0.1),
        "probes_while_full": {"sent": args.probes} | stats(probes),
    }
    (args.out / "admission_requests.json").write_text(json.dumps(full))
    (args.out / "admission_two_routers_cpu.json").write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main(parse_args(sys.argv[1:]))
