"""Bench-only, for ``run_admission_cpu.py``: the burst of streamed chat requests, split
over ``clients`` client processes released at one wall-clock instant.

Each process is ``python benchmarks/admission_clients.py SPEC_JSON``: it builds the same
``streams`` prompts as every other (``bench serve``'s random dataset, one seed), keeps
request ``i`` where ``i % clients == client``, prints ``ready``, reads the start instant
(``time.time()`` seconds) from stdin, sleeps until then and sends its share all at once
through ``bench serve``'s own loop (``dsv3serve.bench.serve.run.run_once``: one asyncio
loop, one pooled httpx client, each request streamed and read to ``[DONE]``). It writes
one record per request to ``out`` (JSON), in wall-clock seconds (one clock for every
process on the host):

- ``task_start``: the request's task began (``bench serve`` starts its timer here);
- ``connect_start`` / ``connect_done``: its TCP connection was opened (httpcore's trace);
- ``sent``: its request head went to the socket (httpcore's trace stamps the start of
  that step; nothing between it and the socket write yields to the event loop, while
  anyio yields once after each write, so a ``complete`` stamp would be one loop round late);
- ``head``: its response head arrived, with ``status``;
- ``done``: the answer was read to its end (or the error body, for a refusal).

Each request carries ``x-bench-id: client:index``, which the proxy-side stamps
(``admission_stamps.py``) key on. The JSON is exchanged through files and pipes as text.
"""

from __future__ import annotations

import asyncio
import contextvars
import json
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from dsv3serve.bench.serve.client import REQUEST_TIMEOUT_S, RequestResult, httpx
from dsv3serve.bench.serve.config import BenchServeConfig
from dsv3serve.bench.serve.dataset import sample_requests
from dsv3serve.bench.serve.prompts import BenchRequest
from dsv3serve.bench.serve.run import Target, load_tokenizer, run_once

BENCH_ID_HEADER = "x-bench-id"
TRACE_STAMPS = {
    "connection.connect_tcp.started": "connect_start",
    "connection.connect_tcp.complete": "connect_done",
    "http11.send_request_headers.started": "sent",
    "http11.receive_response_headers.complete": "head",
}


@dataclass(frozen=True)
class ClientSpec:
    """One client process's share of the burst."""

    base_url: str
    model: str
    streams: int
    clients: int
    client: int
    input_len: int
    output_len: int
    seed: int
    out: str


@dataclass
class Stamps:
    """One request's wall-clock times (None: that step did not happen)."""

    id: str
    index: int
    client: int
    task_start: float
    connect_start: float | None = None
    connect_done: float | None = None
    sent: float | None = None
    head: float | None = None
    status: int | None = None
    done: float | None = None
    success: bool = False
    error: str = ""

    async def trace(self, event: str, info: dict[str, object]) -> None:
        """httpcore's ``trace`` extension: stamp the steps of :data:`TRACE_STAMPS`."""
        name = TRACE_STAMPS.get(event)
        if name is None:
            return
        setattr(self, name, time.time())
        if name == "head":
            returned = info.get("return_value")
            if isinstance(returned, tuple) and len(returned) > 1:
                self.status = int(returned[1])

    def record(self) -> dict[str, object]:
        return asdict(self)


CURRENT: contextvars.ContextVar[Stamps] = contextvars.ContextVar("admission_stamps")


async def tag_request(request: httpx.Request) -> None:
    """httpx's request hook: the bench id header and the trace of the current request."""
    stamps = CURRENT.get(None)
    if stamps is not None:
        request.headers[BENCH_ID_HEADER] = stamps.id
        request.extensions["trace"] = stamps.trace


@dataclass
class StampedTarget(Target):
    """``bench serve``'s target, stamping each request it sends."""

    client_index: int = 0
    index_of: dict[int, int] = field(default_factory=dict)  # id(request) -> global index
    stamps: list[Stamps] = field(default_factory=list)

    async def send(self, config: BenchServeConfig, req: BenchRequest) -> RequestResult:
        index = self.index_of[id(req)]
        stamps = Stamps(f"{self.client_index}:{index}", index, self.client_index, time.time())
        self.stamps.append(stamps)
        CURRENT.set(stamps)  # this request's own task: its context is its own
        result = await super().send(config, req)
        stamps.done, stamps.success, stamps.error = time.time(), result.success, result.error
        return result


def bench_config(spec: ClientSpec) -> BenchServeConfig:
    return BenchServeConfig(
        base_url=spec.base_url,
        model=spec.model,
        num_prompts=spec.streams,
        random_input_len=spec.input_len,
        random_output_len=spec.output_len,
        max_concurrency=spec.streams,
        ignore_eos=True,
        seed=spec.seed,
        disable_tqdm=True,
        warmup_requests=0,
    )


async def burst(
    spec: ClientSpec, start_at: float, target: StampedTarget, mine: list[BenchRequest]
) -> None:
    """Sleep until ``start_at``, then send ``mine`` through ``bench serve``'s loop."""
    await asyncio.sleep(max(0.0, start_at - time.time()))
    await run_once(bench_config(spec), target, mine)


def main(spec: ClientSpec) -> None:
    config = bench_config(spec)
    tokenizer = load_tokenizer(config)
    requests = sample_requests(config, tokenizer)
    mine = [r for i, r in enumerate(requests) if i % spec.clients == spec.client]
    index_of = {id(r): i for i, r in enumerate(requests)}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)

    async def run(start_at: float) -> list[Stamps]:
        async with httpx.AsyncClient(
            timeout=httpx.Timeout(REQUEST_TIMEOUT_S),
            limits=limits,
            event_hooks={"request": [tag_request]},
        ) as client:
            target = StampedTarget(client, spec.model, tokenizer, spec.client, index_of)
            await burst(spec, start_at, target, mine)
            return target.stamps

    print("ready", flush=True)
    start_at = float(sys.stdin.readline())
    stamps = asyncio.run(run(start_at))
    Path(spec.out).write_text(json.dumps([s.record() for s in stamps]))


if __name__ == "__main__":
    main(ClientSpec(**json.loads(sys.argv[1])))
