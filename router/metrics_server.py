"""The internal ``/metrics`` endpoint: the router's metrics merged with its workers'.

Prometheus scrapes one target per router replica: replica k (its rank on its node)
binds ``router.metrics_port + k`` (never published: loopback locally, the pod network in
Kubernetes), labelled ``replica="router-<rank>"``. At each scrape, router rank 0 also asks
every worker replica for its exposition and merges families by name, so each metric
appears once with one HELP/TYPE and samples labelled by role and replica; the other
routers expose only their own series, so no worker series is scraped twice.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

WORKER_SCRAPE_TIMEOUT_S = 5.0
TEXT_FORMAT = "text/plain; version=0.0.4; charset=utf-8"
logger = logging.getLogger(__name__)


class MergedCollector(Collector):
    """The router's own registry plus every worker's exposition, merged by family."""

    def __init__(self, own: CollectorRegistry, workers: Sequence[Any]) -> None:
        self.own = own
        self.workers = list(workers)  # Serve handles with a ``metrics`` method

    def collect(self) -> Iterator[Metric]:
        families: dict[str, Metric] = {}
        for family in self.own.collect():
            families[family.name] = family
        for handle in self.workers:
            try:
                text = handle.metrics.remote().result(timeout_s=WORKER_SCRAPE_TIMEOUT_S)
            except Exception:  # a dead or busy replica: its series are absent this scrape
                continue
            for family in text_string_to_metric_families(text.decode()):
                if family.name in families:
                    families[family.name].samples.extend(family.samples)
                else:
                    families[family.name] = family
        yield from families.values()


class _Handler(BaseHTTPRequestHandler):
    """GET /metrics in the classic text format 0.0.4, whatever the scraper asks for.

    prometheus_client's own server answers an OpenMetrics request with names escaped
    (``dsv3serve:x`` becomes ``dsv3serve_x``); the text format keeps them as defined.
    """

    registry: CollectorRegistry

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        if self.path.split("?")[0] not in ("/metrics", "/"):
            self.send_error(404)
            return
        body = generate_latest(self.registry)
        self.send_response(200)
        self.send_header("Content-Type", TEXT_FORMAT)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - quiet
        return


def serve_metrics(
    own: CollectorRegistry, workers: Sequence[Any], host: str, port: int
) -> ThreadingHTTPServer | None:
    """Start the endpoint in a background thread; returns the HTTP server.

    A port already taken (e.g. by another process) is logged and skipped: serving must
    not fail for want of a metrics port.
    """
    registry = CollectorRegistry(auto_describe=False)
    registry.register(MergedCollector(own, workers))
    handler = type("MetricsHandler", (_Handler,), {"registry": registry})
    try:
        server = ThreadingHTTPServer((host, port), handler)
    except OSError as exc:
        logger.warning("metrics endpoint %s:%d not started: %s", host, port, exc)
        return None
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="metrics", daemon=True).start()
    return server
