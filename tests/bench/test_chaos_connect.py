"""``bench serve --chaos`` joins the loopback cluster that ``dsv3serve serve`` starts.

Found on the way to the GPU serving run: with ``--ray-address auto`` Ray paired the local
GCS port with the machine's routable address, where a loopback cluster does not listen, and
the benchmark retried without end."""

from __future__ import annotations

import subprocess
import sys

STARTER = (
    "import sys\n"
    "from router.launch import init_local_ray\n"
    "init_local_ray()\n"
    "print('up', flush=True)\n"
    "sys.stdin.read()\n"
)
JOINER = (  # as bench serve --chaos: ray is first imported by connect
    "from dsv3serve.bench.serve.chaos import connect\n"
    "connect('auto')\n"
    "import ray\n"
    "print(ray.get_runtime_context().gcs_address, flush=True)\n"
)


def test_auto_finds_the_loopback_cluster_of_dsv3serve_serve() -> None:
    starter = subprocess.Popen(
        [sys.executable, "-c", STARTER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert starter.stdout is not None and starter.stdout.readline().strip() == "up"
        joined = subprocess.run(
            [sys.executable, "-c", JOINER], capture_output=True, text=True, timeout=120
        )
        assert joined.returncode == 0, joined.stderr[-2000:]
        assert joined.stdout.strip().startswith("127.0.0.1:"), joined.stdout
    finally:
        assert starter.stdin is not None
        starter.stdin.close()
        starter.wait(timeout=120)
