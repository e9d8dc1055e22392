"""``dsv3serve serve`` stops gracefully on SIGTERM (issue 29 item 2).

Real subprocess, real local Ray, the embedded default app (two routers) with
``router.graceful_shutdown_timeout_s`` set short. Ten streams are in flight when SIGTERM
comes: each must either finish with a ``finish_reason`` or end with an error event and
``data: [DONE]``; a request sent during the drain gets 503 with ``Retry-After`` and an
OpenAI error body; the process exits within the bound plus a margin for Serve and Ray.
"""

from __future__ import annotations

import json
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
import yaml
from serve_process import start_serve
from serving_util import free_port

from router.launch import local_pd_config

pytestmark = pytest.mark.slow

BOUND_S = 8.0
STOP_MARGIN_S = 60.0  # serve.shutdown and ray.shutdown after the drain, on a loaded CPU
MODEL = "deepseek-v3-tiny"


@dataclass
class Stream:
    """What one streamed chat completion received."""

    max_tokens: int
    started: threading.Event = field(default_factory=threading.Event)
    events: list[str] = field(default_factory=list)
    failure: str | None = None

    def run(self, url: str) -> None:
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": "Count."}],
            "max_tokens": self.max_tokens,
            "stream": True,
            "ignore_eos": True,
        }
        try:
            with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=60) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        self.events.append(line.removeprefix("data: "))
                        self.started.set()
        except httpx.HTTPError as exc:
            self.failure = repr(exc)
        finally:
            self.started.set()

    def outcome(self) -> str:
        """ "finished", "cut" (an error event, then [DONE]), or what was wrong."""
        if self.failure is not None or not self.events or self.events[-1] != "[DONE]":
            return f"broken: {self.failure} {self.events[-2:]}"
        last = json.loads(self.events[-2])
        if "error" in last:
            return "cut"
        reasons = [
            c.get("finish_reason") for e in self.events[:-1] for c in json.loads(e)["choices"]
        ]
        return "finished" if any(reasons) else f"broken: no finish_reason {self.events[-2:]}"


def short_bound_config(tmp_path: Path) -> Path:
    data = local_pd_config()
    data["applications"][0]["args"]["router"]["graceful_shutdown_timeout_s"] = BOUND_S
    path = tmp_path / "short-bound.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def refused_while_draining(url: str, streams: list[Stream]) -> httpx.Response:
    """Non-streamed requests until one is refused (those admitted before the drain began
    are answered normally); fails once the long streams have ended."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
    while any(s.events and s.events[-1] != "[DONE]" for s in streams):
        reply = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
        if reply.status_code != 200:
            return reply
    raise AssertionError("no request was refused while the streams drained")


def test_sigterm_drains_streams_refuses_new_requests_and_exits(tmp_path: Path) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = start_serve(port, short_bound_config(tmp_path), "--grpc-port", str(free_port()))
    streams = [Stream(8) for _ in range(5)] + [Stream(4000) for _ in range(5)]
    threads = [threading.Thread(target=s.run, args=(url,), daemon=True) for s in streams]
    try:
        for thread in threads:
            thread.start()
        assert all(s.started.wait(timeout=120) for s in streams)
        proc.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        refused = refused_while_draining(url, streams[5:])
        assert refused.status_code == 503, refused.text
        assert refused.headers["Retry-After"].isdigit()
        assert refused.json()["error"]["type"] == "service_unavailable"
        for thread in threads:
            thread.join(timeout=BOUND_S + STOP_MARGIN_S)
        outcomes = [s.outcome() for s in streams]
        assert all(o in ("finished", "cut") for o in outcomes), outcomes
        assert outcomes[5:] == ["cut"] * 5, outcomes  # 4000 tokens take longer than the bound here
        assert proc.wait(timeout=BOUND_S + STOP_MARGIN_S) == 0
        print(f"exited {time.monotonic() - sent:.1f} s after SIGTERM (bound {BOUND_S} s)")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
