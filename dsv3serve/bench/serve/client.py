"""Streams one benchmark request over SSE and times it: TTFT, every ITL, E2E, token counts."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

from dsv3serve.bench.serve.config import BenchServeConfig, BenchServeError
from dsv3serve.bench.serve.prompts import BenchRequest
from dsv3serve.tokenizer.tokenizer import Tokenizer

try:  # openai 3.x ships the client as httpx2; older stacks have httpx
    import httpx2 as httpx
except ImportError:
    import httpx  # type: ignore[no-redef]

REQUEST_TIMEOUT_S = 6 * 3600.0
PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}


@dataclass
class RequestResult:
    """What one request measured; times in seconds from its own send."""

    prompt_len: int
    output_len: int  # requested (max_tokens)
    success: bool = False
    error: str = ""
    start_s: float = 0.0  # send time, from the benchmark's start
    ttft_s: float = 0.0
    e2e_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    output_tokens: int = 0
    server_prompt_tokens: int | None = None
    text: str = ""


def make_client(config: BenchServeConfig) -> httpx.AsyncClient:
    """One pooled client for the whole run, with no per-host connection limit."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    return httpx.AsyncClient(timeout=httpx.Timeout(REQUEST_TIMEOUT_S), limits=limits)


async def first_model_id(client: httpx.AsyncClient, base_url: str) -> str:
    """The first id of ``GET /v1/models``."""
    url = base_url + "/v1/models"
    try:
        resp = await client.get(url)
        resp.raise_for_status()
        return resp.json()["data"][0]["id"]
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as exc:
        raise BenchServeError(f"expected a model list from GET {url}, got {exc!r}") from None


def request_body(config: BenchServeConfig, model: str, req: BenchRequest) -> dict[str, Any]:
    """The JSON body of one streamed request (``extra_request_body`` wins)."""
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": req.output_len,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if config.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": req.prompt}]
    else:
        body["prompt"] = req.prompt
    if config.ignore_eos:
        body["ignore_eos"] = True
    return body | config.extra_request_body


def _event_text(event: dict[str, Any]) -> str:
    """Generated text in one stream event (chat delta, reasoning delta or completion text)."""
    text = ""
    for choice in event.get("choices") or []:
        delta = choice.get("delta") or {}
        text += choice.get("text") or delta.get("content") or delta.get("reasoning_content") or ""
    return text


class _Timer:
    """Folds stream events into a RequestResult as they arrive."""

    def __init__(self, result: RequestResult, sent: float) -> None:
        self.result, self.sent, self.last = result, sent, sent
        self.parts: list[str] = []
        self.usage: dict[str, Any] | None = None

    def event(self, event: dict[str, Any], now: float) -> None:
        if event.get("error"):
            raise BenchServeError(f"error event in stream: {json.dumps(event['error'])}")
        self.usage = event.get("usage") or self.usage
        text = _event_text(event)
        if not text:
            return
        if not self.parts:
            self.result.ttft_s = now - self.sent
        else:
            self.result.itl_s.append(now - self.last)
        self.parts.append(text)
        self.last = now

    def finish(self, now: float, tokenizer: Tokenizer) -> None:
        result, usage = self.result, self.usage or {}
        result.text = "".join(self.parts)
        result.e2e_s = now - self.sent
        if not self.parts:  # nothing visible came: the first token is the end
            result.ttft_s = result.e2e_s
        counted = usage.get("completion_tokens")
        if not isinstance(counted, int):  # the server sent no usage: count the text
            counted = len(tokenizer.encode(result.text, add_bos=False))
        result.output_tokens = counted
        result.server_prompt_tokens = usage.get("prompt_tokens")
        result.success = True


async def _stream(
    client: httpx.AsyncClient, url: str, body: dict[str, Any], timer: _Timer
) -> float:
    """Feed the response's events to ``timer``; returns when the stream ended ([DONE])."""
    async with client.stream("POST", url, json=body) as resp:
        if resp.status_code != 200:
            detail = (await resp.aread()).decode("utf-8", "replace")[:300]
            raise BenchServeError(f"HTTP {resp.status_code}: {detail}")
        async for line in resp.aiter_lines():
            now = time.perf_counter()
            data = line[len("data:") :].strip() if line.startswith("data:") else ""
            if data == "[DONE]":
                return now
            if data:
                timer.event(json.loads(data), now)
    return time.perf_counter()


async def send_request(
    client: httpx.AsyncClient,
    config: BenchServeConfig,
    model: str,
    req: BenchRequest,
    tokenizer: Tokenizer,
) -> RequestResult:
    """Send ``req`` streamed, time it; failures are recorded in the result, never raised."""
    result = RequestResult(req.prompt_len, req.output_len)
    url = config.base_url + PATHS[config.endpoint]
    timer = _Timer(result, time.perf_counter())
    try:
        end = await _stream(client, url, request_body(config, model, req), timer)
        timer.finish(end, tokenizer)
    except (BenchServeError, httpx.HTTPError, ValueError) as exc:
        result.error = str(exc) or type(exc).__name__
        result.e2e_s = time.perf_counter() - timer.sent  # when it failed
    return result
