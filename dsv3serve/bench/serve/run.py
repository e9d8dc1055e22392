"""``dsv3serve bench serve``: load an OpenAI-compatible server, print a table, write JSON.

Requests arrive as a Poisson process at ``request_rate`` (all at once for ``inf``), at
most ``max_concurrency`` in flight; each is streamed and timed by ``client``. Like
SGLang's ``bench_serving`` and vLLM's ``benchmark_serving``. With ``--chaos`` replicas are
killed during the run (``chaos``).
"""

from __future__ import annotations

import asyncio
import json
import math
import platform
import random
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass, fields
from typing import Any

from tqdm import tqdm

from dsv3serve.bench.serve import chaos
from dsv3serve.bench.serve.client import (
    RequestResult,
    first_model_id,
    httpx,
    make_client,
    send_request,
)
from dsv3serve.bench.serve.config import BenchServeConfig, BenchServeError
from dsv3serve.bench.serve.dataset import sample_requests
from dsv3serve.bench.serve.kv_counters import kv_moved, read_kv_counters
from dsv3serve.bench.serve.metrics import format_table, jsonable, per_request, summarize
from dsv3serve.bench.serve.multi_turn import ttft_by_kind
from dsv3serve.bench.serve.prompts import BenchRequest
from dsv3serve.tokenizer.locate import tokenizer_dir
from dsv3serve.tokenizer.tokenizer import Tokenizer


@dataclass
class Target:
    """What every request of a run shares: the client, the model id and the tokenizer."""

    client: httpx.AsyncClient
    model: str
    tokenizer: Tokenizer

    async def send(self, config: BenchServeConfig, req: BenchRequest) -> RequestResult:
        return await send_request(self.client, config, self.model, req, self.tokenizer)


async def arrivals(
    requests: list[BenchRequest], rate: float, seed: int
) -> AsyncGenerator[BenchRequest, None]:
    """Yield ``requests`` with exponential gaps of mean ``1 / rate`` s (none for inf)."""
    rng = random.Random(seed)
    for i, req in enumerate(requests):
        if i and math.isfinite(rate):
            await asyncio.sleep(rng.expovariate(rate))
        yield req


async def run_once(
    config: BenchServeConfig,
    target: Target,
    requests: list[BenchRequest],
    start: float | None = None,
) -> tuple[list[RequestResult], float]:
    """Send every request on the arrival schedule; returns results and the duration
    (``start``: the ``perf_counter`` times are measured from; default: now)."""
    gate = asyncio.Semaphore(config.max_concurrency or len(requests))
    bar = tqdm(total=len(requests), disable=config.disable_tqdm, desc="requests")
    start = time.perf_counter() if start is None else start

    async def one(req: BenchRequest) -> RequestResult:
        async with gate:
            sent = time.perf_counter() - start
            result = await target.send(config, req)
        result.start_s = sent
        bar.update(1)
        return result

    tasks = []
    async for req in arrivals(requests, config.request_rate, config.seed):
        tasks.append(asyncio.create_task(one(req)))
    results = await asyncio.gather(*tasks)
    duration = time.perf_counter() - start
    bar.close()
    return list(results), duration


async def warm_up(config: BenchServeConfig, target: Target, req: BenchRequest) -> None:
    """Send ``warmup_requests`` copies of the first request; any failure stops the run."""
    for _ in range(config.warmup_requests):
        result = await target.send(config, req)
        if not result.success:
            raise BenchServeError(f"warm-up request to {config.base_url} failed: {result.error}")


def run_header(config: BenchServeConfig, model: str) -> dict[str, Any]:
    """The settings one run reports beside its metrics."""
    return {
        "Endpoint": f"{config.base_url} ({config.endpoint})",
        "Model": model,
        "Dataset": config.dataset_name,
        "Request rate (req/s)": str(config.request_rate),
        "Max concurrency": str(config.max_concurrency or "not set"),
        "Ignore EOS": str(config.ignore_eos),
    }


def run_record(
    config: BenchServeConfig, model: str, results: list[RequestResult], duration: float
) -> dict[str, Any]:
    """The JSON record of one run: settings, summary and per-request lists."""
    settings = {
        "base_url": config.base_url,
        "endpoint": config.endpoint,
        "model": model,
        "dataset_name": config.dataset_name,
        "dataset_path": str(config.dataset_path) if config.dataset_path else None,
        "num_prompts": config.num_prompts,
        "random_input_len": config.random_input_len,
        "random_output_len": config.random_output_len,
        "random_range_ratio": config.random_range_ratio,
        "request_rate": config.request_rate,
        "max_concurrency": config.max_concurrency,
        "ignore_eos": config.ignore_eos,
        "seed": config.seed,
    }
    if config.dataset_name == "generated-shared-prefix":
        settings |= {f.name: getattr(config, f.name) for f in fields(config) if "gsp_" in f.name}
    if config.dataset_name == "multi-turn":
        settings |= {f.name: getattr(config, f.name) for f in fields(config) if "mt_" in f.name}
    return settings | summarize(results, duration) | per_request(results)


async def run_points(config: BenchServeConfig, tokenizer: Tokenizer) -> list[dict[str, Any]]:
    """Warm up once, then run each point of ``config`` (one, or a sweep's)."""
    requests = sample_requests(config, tokenizer)
    async with make_client(config) as client:
        model = config.model or await first_model_id(client, config.base_url)
        target = Target(client, model, tokenizer)
        await warm_up(config, target, requests[0])
        if config.chaos:
            return [await run_chaos(config, target, requests)]
        records = []
        for point in config.points():
            before = await read_kv_counters(client, config.metrics_urls)
            results, duration = await run_once(point, target, requests)
            after = await read_kv_counters(client, config.metrics_urls)
            record = run_record(point, model, results, duration) | kv_moved(before, after)
            if point.dataset_name == "multi-turn":
                record |= ttft_by_kind(requests, results)
            print(format_table(record, run_header(point, model)), flush=True)
            records.append(record)
    return records


async def run_chaos(
    config: BenchServeConfig, target: Target, requests: list[BenchRequest]
) -> dict[str, Any]:
    """One run with the ``--chaos`` kills injected; its record has a ``chaos`` part."""
    await asyncio.to_thread(chaos.connect, config.ray_address)
    before = await chaos.migrations(target.client, config.metrics_urls)
    start = time.perf_counter()
    injecting = asyncio.create_task(chaos.inject(config.chaos, config.chaos_app, start))
    results, duration = await run_once(config, target, requests, start)
    kills = await injecting  # a kill planned after the last request still happens
    after = await chaos.migrations(target.client, config.metrics_urls)
    migrated = None if before is None or after is None else after - before
    report = chaos.chaos_report(results, duration, kills, migrated)
    record = run_record(config, target.model, results, duration) | {
        "chaos_spec": [vars(e) for e in config.chaos],
        "chaos": report,
    }
    print(format_table(record, run_header(config, target.model)), flush=True)
    print(chaos.format_chaos(report), flush=True)
    return record


def load_tokenizer(config: BenchServeConfig) -> Tokenizer:
    """``--tokenizer``'s directory, or the published DeepSeek-V3 tokenizer."""
    return Tokenizer.from_dir(config.tokenizer or tokenizer_dir("tiny"))


def _meta() -> dict[str, Any]:
    return {
        "date": time.strftime("%Y-%m-%d"),
        "machine": platform.processor() or platform.machine(),
        "python": platform.python_version(),
    }


def sweep_kind(config: BenchServeConfig) -> str | None:
    """The swept setting's name, or None for a single run."""
    if config.request_rate_sweep:
        return "request_rate"
    return "max_concurrency" if config.concurrency_sweep else None


def run_bench_serve(config: BenchServeConfig) -> list[dict[str, Any]]:
    """Run the benchmark (or sweep), print tables, write ``output_file`` and ``plot``."""
    records = asyncio.run(run_points(config, load_tokenizer(config)))
    if config.output_file is not None:
        body = {"sweep": sweep_kind(config), "runs": records} if sweep_kind(config) else records[0]
        config.output_file.write_text(json.dumps(jsonable(body | {"meta": _meta()}), indent=2))
    if config.plot is not None:
        from dsv3serve.bench.serve.plot import plot_chaos, plot_sweep

        if config.chaos:
            plot_chaos(records[0], config.plot)
        else:
            plot_sweep(records, config, config.plot)
    return records
