"""The internal ``/metrics`` endpoint: the router's metrics merged with its workers'.

Prometheus scrapes one target, the router replica's metrics port (never published:
bind it to loopback locally, to the pod network in Kubernetes). At each scrape the
router asks every worker replica for its exposition and merges families by name, so
each metric appears once with one HELP/TYPE and samples labelled by role and replica.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

WORKER_SCRAPE_TIMEOUT_S = 5.0
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


def serve_metrics(
    own: CollectorRegistry, workers: Sequence[Any], host: str, port: int
) -> Any | None:
    """Start the endpoint in a background thread; returns the HTTP server.

    A port already taken (a second router replica on the node) is logged and skipped:
    serving must not fail for want of a metrics port.
    """
    registry = CollectorRegistry(auto_describe=False)
    registry.register(MergedCollector(own, workers))
    try:
        server, _thread = start_http_server(port, addr=host, registry=registry)
    except OSError as exc:
        logger.warning("metrics endpoint %s:%d not started: %s", host, port, exc)
        return None
    return server
