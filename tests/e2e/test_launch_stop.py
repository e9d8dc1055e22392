"""``dsv3serve serve`` stops on Ctrl-C after a router replica was killed mid-stream.

Issue 21: with streams in flight through a router replica that was then killed, the
process did not exit on SIGINT or SIGTERM (it spun in the interpreter's final garbage
collection after Ray's driver shut down; seen in 2 of 4 runs of this scenario before the
fix). Real subprocess, real local Ray, the embedded default app with one router replica, as
in the issue; the router replica's process is killed as ``ray.kill`` would.
"""

from __future__ import annotations

import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest
import yaml
from serve_process import start_serve
from serving_util import free_port, wait_until

from router.launch import local_pd_config

pytestmark = pytest.mark.slow

STOP_S = 60  # serve.shutdown's own bound is 30 s; the rest is Ray's
STREAMS = 8


def one_router_config(tmp_path: Path) -> Path:
    data = local_pd_config()
    data["applications"][0]["args"]["router"]["num_replicas"] = 1
    path = tmp_path / "one-router.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def stream_forever(url: str, stop: threading.Event) -> None:
    body = {
        "model": "deepseek-v3-tiny",
        "messages": [{"role": "user", "content": "Count."}],
        "max_tokens": 2000,
        "stream": True,
        "ignore_eos": True,
    }
    while not stop.is_set():
        try:
            with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=30) as r:
                for _ in r.iter_bytes():
                    if stop.is_set():
                        return
        except httpx.HTTPError:
            time.sleep(0.1)


def router_processes(proc: subprocess.Popen[str]) -> list[psutil.Process]:
    found = []
    for child in psutil.Process(proc.pid).children(recursive=True):
        try:
            if "ServeReplica:dsv3serve:router" in " ".join(child.cmdline()):
                found.append(child)
        except psutil.Error:
            continue
    return found


@pytest.fixture
def traffic() -> Iterator[tuple[str, threading.Event]]:
    port = free_port()
    stop = threading.Event()
    yield f"http://127.0.0.1:{port}", stop
    stop.set()


def test_serve_exits_on_ctrl_c_after_its_router_replica_was_killed_mid_stream(
    traffic: tuple[str, threading.Event], tmp_path: Path
) -> None:
    url, stop = traffic
    port = int(url.rsplit(":", 1)[1])
    proc = start_serve(port, one_router_config(tmp_path), "--grpc-port", str(free_port()))
    try:
        for _ in range(STREAMS):
            threading.Thread(target=stream_forever, args=(url, stop), daemon=True).start()
        time.sleep(3)  # streams decoding through the router
        (router,) = router_processes(proc)
        router.kill()
        time.sleep(3)
        cluster = psutil.Process(proc.pid).children(recursive=True)
        proc.send_signal(signal.SIGINT)
        sent = time.monotonic()
        assert proc.wait(timeout=STOP_S) == 0, "dsv3serve serve failed on Ctrl-C"
        print(f"exited {time.monotonic() - sent:.1f} s after Ctrl-C")
        assert wait_until(lambda: not any(_alive(p) for p in cluster), timeout_s=10)
    finally:
        stop.set()
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _alive(process: psutil.Process) -> bool:
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False
