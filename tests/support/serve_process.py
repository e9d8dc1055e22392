"""``dsv3serve serve`` as a real subprocess for the e2e tests: its output read all the time
(the pipe never fills), a start bound that fits a loaded 2-core box, and the process's
last lines in every failure."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections import deque
from pathlib import Path

SERVE = "import sys; from dsv3serve.cli import main; sys.exit(main())"
# The server's own bound (--start-timeout): Serve's proxy, then the app, each within it; it
# names what did not start. Generous: on a 2-core box another process keeps busy, Ray
# takes ~20 s and the four replicas of the tiny app a minute or more.
SERVER_START_S = 180
# Ours only catches a server that says nothing: its two stages plus Ray's start.
STARTUP_S = 2 * SERVER_START_S + 90
UP_LINE = "Ctrl-C stops it."
RAY_NOT_STARTED = "not started: the local Ray cluster did not start"
TAIL_LINES = 60


class ServeOutput:
    """Reads a process's merged stdout and stderr on a thread, keeping the last lines."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.tail: deque[str] = deque(maxlen=TAIL_LINES)
        self.up = threading.Event()
        self.ended = threading.Event()
        threading.Thread(target=self._read, args=(proc,), daemon=True).start()

    def _read(self, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            self.tail.append(line.rstrip("\n"))
            if UP_LINE in line:
                self.up.set()
        self.ended.set()

    def wait_up(self, timeout_s: float) -> bool:
        """True once the process printed that it is up; False if it ended or timed out."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and not self.ended.is_set():
            if self.up.wait(timeout=0.5):
                return True
        return self.up.is_set()

    def last_lines(self) -> str:
        return "\n".join(self.tail)


def serve_args(config: Path, port: int) -> list[str]:
    """The command line of ``dsv3serve serve`` in this interpreter."""
    return [sys.executable, "-c", SERVE, "serve", "--config", str(config), "--port", str(port)]


def start_serve(port: int, config: Path, *extra: str) -> subprocess.Popen[str]:
    """Start ``dsv3serve serve`` with ``config`` on ``port`` (plus ``extra`` arguments) and
    wait until it prints that it is up; its output is read until it exits. When the local
    Ray cluster itself did not start (Ray gives its raylet a fixed 30 s to register, which
    a loaded 2-core box can miss; nothing of ours ran yet), it is started once more.

    Raises AssertionError with its exit code and last lines when it exits first or is not
    up within ``STARTUP_S``."""
    for attempt in (1, 2):
        proc, output = _start(port, config, *extra)
        if output.wait_up(STARTUP_S):
            return proc
        code = _ended(proc, output)
        if attempt == 1 and RAY_NOT_STARTED in output.last_lines():
            print(f"the local Ray cluster did not start; once more:\n{output.last_lines()}")
            continue
        raise AssertionError(
            f"dsv3serve serve did not come up (exit code {code}; our bound {STARTUP_S} s); "
            f"its last lines:\n{output.last_lines()}"
        )
    raise AssertionError("unreachable")


def _start(port: int, config: Path, *extra: str) -> tuple[subprocess.Popen[str], ServeOutput]:
    args = [*serve_args(config, port), "--start-timeout", str(SERVER_START_S), *extra]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return proc, ServeOutput(proc)


def _ended(proc: subprocess.Popen[str], output: ServeOutput) -> int:
    """``proc``'s exit code, killed first if it still runs; its output read to the end."""
    if proc.poll() is None:
        proc.kill()
    code = proc.wait()
    output.ended.wait(timeout=10)
    return code
