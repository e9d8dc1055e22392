"""A real local Ray cluster with Serve, and helpers to run our apps on it in tests."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import ray
from http_util import spare_port
from ray import serve

from router.app import bind_app
from router.config import ServingConfig
from router.launch import GRPC_SERVICER, use_proxy_middleware
from workers.protocol import WorkerStats, decode

TINY_ENGINE = {
    "model": "tiny",
    "device": "cpu",
    "page_size": 16,
    "num_kv_tokens": 8192,
    "fp8_act_quant": False,
}


TEST_ROUTER = {"served_model_name": "tiny", "metrics_port": None, "num_replicas": 1}


def serving_config(**fields: Any) -> ServingConfig:
    """The tiny CPU config of the tests, with ``fields`` replacing top-level entries, except
    ``router``, whose keys replace those of :data:`TEST_ROUTER` (one router replica, no
    metrics port: on two shared cores, a test that needs more asks for them)."""
    base: dict[str, Any] = {
        "mode": "pd",
        "engine": TINY_ENGINE,
        "prefill": {"num_cpus": 0.5},
        "decode": {"num_cpus": 0.5},
        "colocated": {"num_cpus": 0.5},
        "torch_threads": 1,
    }
    router = TEST_ROUTER | dict(fields.pop("router", {}))
    return ServingConfig.parse(base | fields | {"router": router})


def free_port() -> int:
    """A TCP port free on loopback now, outside the ports other processes take on their own
    (``http_util.spare_port``)."""
    return spare_port()


def free_port_pair() -> int:
    """A port p with p and p + 1 both free on loopback now (router replicas 0 and 1 bind
    ``metrics_port`` + their rank)."""
    return spare_port(2)


@dataclass(frozen=True)
class ServeCluster:
    """A running local Ray cluster with Serve: where its proxies listen."""

    base: str
    """Serve's HTTP proxy, ``http://127.0.0.1:PORT``."""
    grpc_port: int
    """Serve's gRPC proxy port (dsv3serve.v1.Generation), on loopback."""


@contextmanager
def local_serve() -> Iterator[ServeCluster]:
    """Start Ray (loopback, no dashboard) and Serve's HTTP and gRPC proxies, our proxy
    middlewares in them as ``dsv3serve serve`` sets them up; shut both down after.

    The e2e modules share one (``tests/e2e/conftest.py``: ``serve_cluster``), each
    deploying its apps under names of its own and deleting them when it ends.
    """
    port, grpc_port = spare_port(), spare_port()
    grpc = {"port": grpc_port, "grpc_servicer_functions": [GRPC_SERVICER]}
    use_proxy_middleware()  # as `dsv3serve serve` does: the proxy ends cut streams
    ray.init(num_cpus=8, include_dashboard=False, _node_ip_address="127.0.0.1")
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port}, grpc_options=grpc)
        yield ServeCluster(f"http://127.0.0.1:{port}", grpc_port)
    finally:
        serve.shutdown()
        ray.shutdown()


@contextmanager
def running_app(
    base_url: str, name: str, cfg: ServingConfig, router_options: dict[str, Any] | None = None
) -> Iterator[str]:
    """Deploy ``cfg`` as app ``name`` at ``/name``; yields its URL; deletes it after.

    ``router_options``: Serve deployment options of the router (``router.app.bind_app``).
    """
    serve.run(bind_app(cfg, router_options), name=name, route_prefix=f"/{name}")
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
        and stats.pending_kv == 0
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
