"""Every Prometheus metric of dsv3serve, defined once: names, labels and buckets.

Names follow vLLM / SGLang in our own ``dsv3serve:`` namespace. Each process (router,
prefill, decode or colocated replica) builds its metrics in its own registry with constant
labels ``role``, ``replica`` and ``model`` (plus ``dp_rank`` on engine metrics); label sets
are bounded (never a request id). The router merges its workers' expositions into one
internal endpoint (``router/metrics_server.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from dsv3serve.json_types import JSONObject, json_float, json_int, json_list, json_object, json_str

NS = "dsv3serve:"
disable_created_metrics()  # no *_created series (as vLLM): they double every counter
LATENCY_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0,
)  # fmt: skip
TOKEN_LATENCY_BUCKETS = (
    0.001, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1,
    0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
)  # fmt: skip
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
TOKENS_BUCKETS = (1, 8, 32, 128, 512, 1024, 2048, 4096, 8192, 16384)
BYTES_BUCKETS = tuple(float(4**i) * 1024 for i in range(1, 12))
FINISH_REASONS = ("stop", "length", "abort", "error")
ACCEPT_LENGTH_BUCKETS = (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 16)
MIGRATION_FAILURES = ("exhausted", "unsupported", "no_decode", "failed")
SPEED_BUCKETS = tuple(gb * 1e9 for gb in (0.01, 0.1, 0.5, 1, 2, 5, 10, 20, 50, 100, 200, 400))
DISPATCH_LATENCY_BUCKETS = (
    1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3,
    0.01, 0.025, 0.05, 0.1, 0.25, 1.0,
)  # fmt: skip


@dataclass(frozen=True)
class Identity:
    """Who emits: the constant labels of one process's metrics."""

    role: str  # router | prefill | decode | colocated
    replica: str
    model: str

    def labels(self) -> dict[str, str]:
        return {"role": self.role, "replica": self.replica, "model": self.model}


class Metrics:
    """All metric objects of one process, registered in ``registry``.

    Every process builds the full set (unused ones simply stay at zero), so a dashboard
    query never depends on which process it hits.
    """

    def __init__(self, identity: Identity, registry: CollectorRegistry | None = None) -> None:
        self.identity = identity
        self.registry = registry or CollectorRegistry()
        c = identity.labels()
        names = list(c)

        def hist(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(NS + name, doc, names, registry=self.registry, buckets=buckets).labels(
                **c
            )

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            metric = Counter(NS + name, doc, [*names, *extra], registry=self.registry)
            return metric if extra else metric.labels(**c)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(NS + name, doc, names, registry=self.registry).labels(**c)

        # request latencies (router: as clients see them; workers: their own part)
        self.ttft = hist("time_to_first_token_seconds", "Time to first token.", LATENCY_BUCKETS)
        self.itl = hist(
            "inter_token_latency_seconds", "Time between output tokens.", TOKEN_LATENCY_BUCKETS
        )
        self.e2e = hist("e2e_request_latency_seconds", "End-to-end latency.", LATENCY_BUCKETS)
        self.queue_time = hist(
            "request_queue_time_seconds",
            "Time waiting before the first schedule.",
            LATENCY_BUCKETS,
        )
        self.prefill_time = hist(
            "request_prefill_time_seconds", "Time to prefill a request.", LATENCY_BUCKETS
        )
        self.decode_time = hist(
            "request_decode_time_seconds", "Time from first to last token.", LATENCY_BUCKETS
        )
        # request counters
        self.prompt_tokens = counter("prompt_tokens_total", "Prompt tokens processed.")
        self.generation_tokens = counter("generation_tokens_total", "Tokens generated.")
        self._finished = counter(
            "request_success_total", "Finished requests by finish reason.", ("finished_reason",)
        )
        self._status = counter(
            "requests_total", "Answered requests by protocol and status.", ("protocol", "status")
        )
        # engine internals
        self.batch_size = hist("batch_size", "Sequences in one engine step.", BATCH_BUCKETS)
        self.step_tokens = hist("step_num_tokens", "Tokens in one engine step.", TOKENS_BUCKETS)
        # prefill / decode
        self.transfer_latency = hist(
            "kv_transfer_latency_seconds", "Time to pull one request's KV.", LATENCY_BUCKETS
        )
        self.transfer_size = hist("kv_transfer_size_bytes", "KV bytes per transfer.", BYTES_BUCKETS)
        self.transfer_speed = hist(
            "kv_transfer_speed_bytes_per_second", "KV transfer speed.", SPEED_BUCKETS
        )
        self.transfer_bytes = counter("kv_transfer_bytes_total", "KV bytes moved.")
        self.transfer_pages = counter("kv_transfer_pages_total", "KV pages pulled by decode.")
        self.transfer_overlapped_pages = counter(
            "kv_transfer_overlapped_pages_total",
            "KV pages decode pulled while their prefill still ran (overlapped transfer).",
        )
        self.transfer_reused_pages = counter(
            "kv_transfer_reused_pages_total",
            "Prompt KV pages decode did not pull: its prefix cache held them.",
        )
        self._transfer_failures = counter(
            "kv_transfer_failures_total", "Failed KV transfers by reason.", ("reason",)
        )
        self.waiting_for_kv = gauge(
            "num_requests_waiting_for_kv", "Requests waiting for a decode KV reservation."
        )
        self.in_transfer = gauge("num_requests_in_transfer", "Requests pulling KV now.")
        self.handoff_time = hist(
            "pd_handoff_seconds", "Prefill result to first decode output.", LATENCY_BUCKETS
        )
        # decode-loss migration (router: ``router/pd/migration.py``)
        self.migrations = counter(
            "decode_migrations_total",
            "Streams moved to another decode replica after theirs failed (one per move).",
        )
        self._migration_failures = counter(
            "decode_migration_failures_total",
            "Streams ended with an error after their decode replica failed, by reason.",
            ("reason",),
        )
        self.migration_time = hist(
            "decode_migration_seconds",
            "Decode replica failure to the first token of the migrated stream.",
            LATENCY_BUCKETS,
        )
        # speculative decoding (a round: one sequence's verify with at least one draft)
        self.spec_drafts = counter("spec_decode_num_drafts_total", "Draft rounds.")
        self.spec_draft_tokens = counter("spec_decode_num_draft_tokens_total", "Draft tokens.")
        self.spec_accepted_tokens = counter(
            "spec_decode_num_accepted_tokens_total", "Accepted draft tokens."
        )
        self._spec_accepted_per_pos = counter(
            "spec_decode_num_accepted_tokens_per_pos_total",
            "Accepted draft tokens by draft position (0 = first draft).",
            ("position",),
        )
        self.spec_accept_length = hist(
            "spec_decode_accept_length",
            "Tokens committed per round: accepted drafts + 1.",
            ACCEPT_LENGTH_BUCKETS,
        )

        self._warm_up()

    def _warm_up(self) -> None:
        """Create the labelled series users query, at zero, so rates exist from the start."""
        labels = self.identity.labels()
        for reason in FINISH_REASONS:
            self._finished.labels(**labels, finished_reason=reason)
        for status in ("200", "400", "404", "413", "429", "500", "503"):
            self._status.labels(**labels, protocol="http", status=status)
        for reason in ("error", "timeout"):
            self._transfer_failures.labels(**labels, reason=reason)
        for reason in MIGRATION_FAILURES:
            self._migration_failures.labels(**labels, reason=reason)

    def finished(self, reason: str) -> None:
        """Count one finished sequence (``stop``, ``length``, ``abort``, ``error``)."""
        self._finished.labels(**self.identity.labels(), finished_reason=reason).inc()

    def answered(self, protocol: str, status: int | str) -> None:
        """Count one answered request (``http`` status code or ``grpc`` status name)."""
        labels = self.identity.labels()
        self._status.labels(**labels, protocol=protocol, status=str(status)).inc()

    def spec_observe(self, num_drafts: int, num_accepted: int) -> None:
        """Count one speculative round of ``num_drafts`` drafts, the first ``num_accepted`` kept."""
        self.spec_drafts.inc()
        self.spec_draft_tokens.inc(num_drafts)
        self.spec_accepted_tokens.inc(num_accepted)
        self.spec_accept_length.observe(num_accepted + 1)
        labels = self.identity.labels()
        for position in range(num_accepted):
            self._spec_accepted_per_pos.labels(**labels, position=str(position)).inc()

    def transfer_failed(self, reason: str) -> None:
        """Count one failed transfer (``error`` or ``timeout``)."""
        self._transfer_failures.labels(**self.identity.labels(), reason=reason).inc()

    def migration_failed(self, reason: str) -> None:
        """Count one stream a decode failure ended (one of ``MIGRATION_FAILURES``)."""
        self._migration_failures.labels(**self.identity.labels(), reason=reason).inc()


@dataclass
class EngineState:
    """What an engine reports at scrape time (read without stopping it)."""

    running: int
    waiting: int
    kv_usage: float
    prefix_queries: int
    prefix_hits: int
    preemptions: int
    placed: int | None = None  # DP attention: requests this rank took
    prefill_tokens: int = 0  # tokens prefilled (computed), cached ones not counted
    # hierarchical cache (all 0 without a host tier)
    host_hits: int = 0  # prompt tokens loaded back from the host tier
    host_loaded_pages: int = 0
    host_load_seconds: float = 0.0
    host_backed_up_pages: int = 0
    host_pages: int = 0  # the host tier's size in pages
    host_used_pages: int = 0
    fallbacks: int | None = None  # of those, ones a router sent to a rank that could not


class EngineStateCollector(Collector):
    """Engine gauges and cumulative counters, read from the engine when scraped."""

    def __init__(
        self, identity: Identity, read: Callable[[], EngineState], dp_rank: int = 0
    ) -> None:
        self.labels = {**identity.labels(), "dp_rank": str(dp_rank)}
        self.read = read  # () -> EngineState

    def collect(self) -> Iterator[Metric]:
        state: EngineState = self.read()
        names, values = list(self.labels), list(self.labels.values())
        for name, doc, value, family in (
            ("num_requests_running", "Requests in the running batch.", state.running, 0),
            ("num_requests_waiting", "Requests waiting to run.", state.waiting, 0),
            ("kv_cache_usage_perc", "KV cache usage (0-1).", state.kv_usage, 0),
            ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
             state.prefix_queries, 1),
            ("prefix_cache_hits", "Prompt tokens found in the prefix cache.",
             state.prefix_hits, 1),
            ("num_preemptions", "Preempted sequences.", state.preemptions, 1),
            ("prefill_tokens_computed", "Prompt tokens prefilled (not served by a cache).",
             state.prefill_tokens, 1),
            ("prefix_cache_host_hits", "Prompt tokens loaded back from the host tier "
             "(part of prefix_cache_hits).", state.host_hits, 1),
            ("hicache_loaded_pages", "Pages loaded back from the host tier.",
             state.host_loaded_pages, 1),
            ("hicache_load_seconds", "Time spent loading pages back from the host tier.",
             state.host_load_seconds, 1),
            ("hicache_backed_up_pages", "Evicted pages copied to the host tier.",
             state.host_backed_up_pages, 1),
            ("hicache_host_pages", "Pages of the host tier.", state.host_pages, 0),
            ("hicache_host_used_pages", "Host-tier pages holding KV.", state.host_used_pages, 0),
            ("dp_rank_requests", "Requests this DP rank took (DP attention).",
             state.placed, 1),
            ("dp_rank_fallbacks", "Requests this DP rank took because the rank the router "
             "chose was invalid or full.", state.fallbacks, 1),
        ):  # fmt: skip
            if value is None:
                continue
            kind = CounterMetricFamily if family else GaugeMetricFamily
            metric = kind(NS + name, doc, labels=names)
            metric.add_metric(values, value)
            yield metric


class DispatchStatsCollector(Collector):
    """Expert-parallel dispatch / combine latency and bytes of every rank of a group.

    ``read`` returns snapshots of :class:`~dsv3serve.parallel.dispatch_meter.DispatchMeter`
    (plain data, possibly from other processes: a worker's rank 0 gathers its followers');
    each becomes ``dsv3serve:moe_dispatch_seconds`` (histogram, one observation per call)
    and ``dsv3serve:moe_dispatch_bytes_total`` (counter) with labels ``rank``, ``phase``
    (``dispatch`` / ``combine``) and ``mode`` (``a2a``, ``normal``, ``low_latency``).
    """

    def __init__(self, identity: Identity, read: Callable[[], list[JSONObject]]) -> None:
        self.labels = identity.labels()
        self.read = read

    def collect(self) -> Iterator[Metric]:
        names = [*self.labels, "rank", "phase", "mode"]
        seconds = HistogramMetricFamily(
            NS + "moe_dispatch_seconds",
            "Expert-parallel dispatch / combine time per call (CUDA events on GPU).",
            labels=names,
        )
        nbytes = CounterMetricFamily(
            NS + "moe_dispatch_bytes",
            "Expert-side row bytes: received by dispatch, sent back by combine.",
            labels=names,
        )
        for snap in self.read():
            for phase in json_list(snap["phases"], "phases"):
                p = json_object(phase, "phase")
                kind = [json_str(p["phase"], "phase"), json_str(p["mode"], "mode")]
                values = [*self.labels.values(), str(snap["rank"]), *kind]
                buckets = [json_int(c, "bucket") for c in json_list(p["buckets"], "buckets")]
                seconds.add_metric(
                    values, _cumulative(buckets), json_float(p["seconds"], "seconds")
                )
                nbytes.add_metric(values, json_int(p["bytes"], "bytes"))
        yield seconds
        yield nbytes


class EplbHotRatioCollector(Collector):
    """``dsv3serve:eplb_hot_expert_ratio`` (gauge, label ``layer``: the MoE layer's row,
    bounded by the model's layer count): tokens of the busiest logical expert over the mean,
    over the group's last EPLB window. ``read`` returns one float per MoE layer (empty before
    the first rebalance; nothing is then exported)."""

    def __init__(self, identity: Identity, read: Callable[[], list[float]]) -> None:
        self.labels = identity.labels()
        self.read = read

    def collect(self) -> Iterator[Metric]:
        ratios = self.read()
        if not ratios:
            return
        gauge = GaugeMetricFamily(
            NS + "eplb_hot_expert_ratio",
            "Busiest logical expert's routed tokens over the mean, per MoE layer.",
            labels=[*self.labels, "layer"],
        )
        for layer, ratio in enumerate(ratios):
            gauge.add_metric([*self.labels.values(), str(layer)], ratio)
        yield gauge


def _cumulative(counts: list[int]) -> list[tuple[str, float]]:
    """Per-bucket counts (last: +Inf) -> Prometheus' cumulative ``(le, count)`` pairs."""
    bounds = [*(str(b) for b in DISPATCH_LATENCY_BUCKETS), "+Inf"]
    total, out = 0, list[tuple[str, float]]()
    for bound, count in zip(bounds, counts, strict=True):
        total += count
        out.append((bound, total))
    return out


class TierReading(Protocol):
    """What the metrics read of a host tier (``kvcache.host_tier.HostTier``)."""

    @property
    def num_pages(self) -> int: ...

    @property
    def used_pages(self) -> int: ...

    @property
    def stats(self) -> TierCounters: ...


class TierCounters(Protocol):
    """The host tier's cumulative counters (``kvcache.host_tier.TierStats``)."""

    hit_tokens: int
    loaded_pages: int
    backed_up_pages: int
    load_seconds: float


def with_tier_state(state: EngineState, tier: TierReading) -> EngineState:
    """``state`` with the hierarchical cache's counters of ``tier`` filled in."""
    stats = tier.stats
    return replace(
        state,
        host_hits=stats.hit_tokens,
        host_loaded_pages=stats.loaded_pages,
        host_load_seconds=stats.load_seconds,
        host_backed_up_pages=stats.backed_up_pages,
        host_pages=tier.num_pages,
        host_used_pages=tier.used_pages,
    )
