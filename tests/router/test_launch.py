"""``router.launch``: the local Ray cluster of ``dsv3serve serve`` and its HTTP options."""

from __future__ import annotations

import ipaddress
import json
import subprocess
import sys

import pytest
import ray

from router.api.proxy_admission import PROXY_ADMISSION_ENV
from router.api.proxy_middleware import PROXY_CALLBACK_ENV
from router.launch import LOOPBACK_RAY_ENV, http_options, init_local_ray, local_pd_config
from router.launch_start import PROXY_READY_ENV, StartupError
from router.launch_usage import usage_text

# In a fresh interpreter (ray must not be imported before the launcher sets it up):
# start the cluster as `dsv3serve serve` does, run one task so a worker exists, then list
# every TCP socket that this process or any of its descendants listens on.
LISTENERS = """
import json, psutil
from router.launch import init_local_ray
init_local_ray()
import ray
ray.get(ray.remote(lambda: 1).remote())
me = psutil.Process()
tree = {me.pid: "driver"} | {p.pid: p.name() for p in me.children(recursive=True)}
sockets = [c for c in psutil.net_connections("tcp") if c.status == "LISTEN" and c.pid in tree]
print(json.dumps(sorted({(tree[c.pid], c.laddr.ip) for c in sockets})))
ray.shutdown()
"""


def _loopback(ip: str) -> bool:
    address = ipaddress.ip_address(ip)
    mapped = getattr(address, "ipv4_mapped", None)
    return (mapped or address).is_loopback


def test_local_cluster_binds_every_ray_port_to_loopback() -> None:
    done = subprocess.run(
        [sys.executable, "-c", LISTENERS], capture_output=True, text=True, timeout=240
    )
    assert done.returncode == 0, done.stderr[-3000:]
    listeners = [tuple(pair) for pair in json.loads(done.stdout.strip().splitlines()[-1])]
    processes = {name for name, _ in listeners}
    assert {"gcs_server", "raylet", "driver"} <= processes, listeners
    exposed = [(name, ip) for name, ip in listeners if not _loopback(ip)]
    assert not exposed, f"expected only loopback listeners, found {exposed}"


def test_http_options_keep_the_deploy_files_serve_settings() -> None:
    data = local_pd_config()
    data["http_options"] |= {"keep_alive_timeout_s": 7, "request_timeout_s": 600}
    options = http_options(data, port=8123)
    assert options == {
        "host": "127.0.0.1",
        "port": 8123,
        "keep_alive_timeout_s": 7,
        "request_timeout_s": 600,
    }
    assert http_options({})["host"] == "127.0.0.1"


def test_printed_python_example_runs_an_interpreter_with_openai() -> None:
    """The usage text's ``python -c`` line names this interpreter, which has openai (a bare
    ``python`` may be a system one without it)."""
    text = usage_text("http://127.0.0.1:8000", "deepseek-v3-tiny")
    line = next(x for x in text.splitlines() if ' -c "from openai import OpenAI' in x)
    interpreter = line.split()[0]
    assert interpreter == sys.executable
    done = subprocess.run([interpreter, "-c", "import openai"], capture_output=True, timeout=60)
    assert done.returncode == 0, done.stderr


def test_a_local_cluster_that_did_not_start_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ray 2.60 gives its raylet a fixed 30 s to register and raises a bare Exception after
    it (seen on a 2-core box another test run kept busy); the launcher names the cluster."""
    for key in (*LOOPBACK_RAY_ENV, PROXY_CALLBACK_ENV, PROXY_ADMISSION_ENV, PROXY_READY_ENV):
        monkeypatch.setenv(key, "")  # restored after the test: init_local_ray sets them
        monkeypatch.delenv(key)

    def late_raylet(**options: object) -> None:
        raise Exception("The current node timed out during startup.")  # as Ray words it

    monkeypatch.setattr(ray, "init", late_raylet)
    with pytest.raises(StartupError, match="the local Ray cluster did not start: The current"):
        init_local_ray()
