"""``dsv3serve serve`` as a child process for benchmarks/serve_gpu.py: start, first answer,
stop (SIGTERM, as a user's Ctrl-C), and the check that the GPUs are free again."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path


class App:
    """``dsv3serve serve --config CONFIG`` started now, its output in ``log_path``."""

    def __init__(self, config: str, cache_dir: Path, log_path: Path) -> None:
        self.log_path = log_path
        self._log = log_path.open("w")
        self.t0 = time.monotonic()
        cmd = [
            sys.executable,
            "-m",
            "dsv3serve.cli",
            "serve",
            "--config",
            str(config),
            "--cache-dir",
            str(cache_dir),
        ]
        self.proc = subprocess.Popen(
            cmd, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True
        )

    def _tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def wait_first_answer(self, url: str, model: str, timeout_s: float) -> float:
        """Seconds from the command to the first answered chat completion; raises
        RuntimeError (with the log's tail) if the app exits or does not answer in time."""
        from openai import OpenAI

        client = OpenAI(base_url=f"{url}/v1", api_key="none", timeout=60, max_retries=0)
        while True:
            elapsed = time.monotonic() - self.t0
            if self.proc.poll() is not None:
                raise RuntimeError(f"serve exited ({self.proc.returncode}):\n{self._tail()}")
            if "EngineDeadError" in self.log_path.read_text(errors="replace"):
                raise RuntimeError(f"an engine died while starting:\n{self._tail()}")
            if elapsed > timeout_s:
                raise RuntimeError(f"no answer in {timeout_s:.0f} s:\n{self._tail()}")
            try:
                client.chat.completions.create(
                    model=model,
                    messages=[{"role": "user", "content": "Hello!"}],
                    max_tokens=4,
                    temperature=0,
                )
                return time.monotonic() - self.t0
            except Exception:  # not up yet: the router answers 503 or refuses the connection
                time.sleep(1.0)

    def stop(self, timeout_s: float = 90.0) -> dict[str, object]:
        """SIGTERM, wait up to ``timeout_s`` (then SIGKILL the process group), then stop
        whatever of its Ray cluster is left."""
        t0 = time.monotonic()
        self.proc.send_signal(signal.SIGTERM)
        try:
            code: object = self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            code = "killed after SIGTERM timed out"
        stop_s = round(time.monotonic() - t0, 1)
        subprocess.run(
            [sys.executable, "-m", "ray.scripts.scripts", "stop", "--force"],
            capture_output=True,
            timeout=120,
        )
        self._log.close()
        return {"exit_code": code, "stop_s": stop_s}


def wait_gpus_free(limit_mib: int = 4096, timeout_s: float = 120.0) -> float | None:
    """Seconds until every GPU uses under ``limit_mib`` (None: not within ``timeout_s``;
    0.0 where there is no nvidia-smi)."""
    if shutil.which("nvidia-smi") is None:
        return 0.0
    t0 = time.monotonic()
    query = ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"]
    while time.monotonic() - t0 < timeout_s:
        used = [
            int(v) for v in subprocess.run(query, capture_output=True, text=True).stdout.split()
        ]
        if all(u < limit_mib for u in used):
            return round(time.monotonic() - t0, 1)
        time.sleep(1.0)
    return None
