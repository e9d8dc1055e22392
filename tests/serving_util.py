"""A real local Ray cluster with Serve, and helpers to run our apps on it in tests."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import ray
from http_util import free_socket
from ray import serve

from router.app import build_app
from router.config import ServingConfig
from workers.protocol import WorkerStats, decode

TINY_ENGINE = {
    "model": "tiny",
    "device": "cpu",
    "page_size": 16,
    "num_kv_tokens": 8192,
    "fp8_act_quant": False,
}


def serving_config(**fields: Any) -> ServingConfig:
    """The tiny CPU config of the tests, with ``fields`` replacing top-level entries."""
    base: dict[str, Any] = {
        "mode": "pd",
        "engine": TINY_ENGINE,
        "prefill": {"num_cpus": 0.5},
        "decode": {"num_cpus": 0.5},
        "colocated": {"num_cpus": 0.5},
        "torch_threads": 1,
        "router": {"served_model_name": "tiny", "metrics_port": None},
    }
    return ServingConfig.parse(base | fields)


@contextmanager
def local_serve() -> Iterator[str]:
    """Start Ray (loopback, no dashboard) and Serve's HTTP proxy; yields the base URL."""
    port = free_socket().getsockname()[1]
    ray.init(num_cpus=8, include_dashboard=False, _node_ip_address="127.0.0.1")
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


@contextmanager
def running_app(base_url: str, name: str, cfg: ServingConfig) -> Iterator[str]:
    """Deploy ``cfg`` as app ``name`` at ``/name``; yields its URL; deletes it after."""
    serve.run(build_app(cfg), name=name, route_prefix=f"/{name}")
    try:
        yield f"{base_url}/{name}"
    finally:
        serve.delete(name)


def worker_stats(app: str, deployment: str) -> WorkerStats:
    """A replica's internal accounting (free pages, live requests, staged KV, ...)."""
    handle = serve.get_deployment_handle(deployment, app_name=app)
    return decode(WorkerStats, handle.stats.remote().result())


def holds_nothing(stats: WorkerStats) -> bool:
    """No request holds anything: every page is free or only prefix-cached."""
    return (
        stats.live_requests == 0
        and stats.staged_kv == 0
        and stats.reservations == 0
        and stats.free_pages + stats.evictable_pages == stats.num_pages
    )


def wait_until(check: Callable[[], bool], timeout_s: float, interval_s: float = 0.1) -> bool:
    """Poll ``check`` until it is true or ``timeout_s`` passes; returns the last result."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(interval_s)
    return check()
