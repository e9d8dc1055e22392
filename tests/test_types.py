"""The type check: mypy over the runtime packages, as ``[tool.mypy]`` in pyproject.toml says.

It checks the Protocols (the engine's step contract, the worker backend, the KV connector)
against what implements and uses them, and the typed wire messages (pydantic, the gRPC
stubs in ``router/proto/generate_pb2.pyi``) where they are built and read. The cache is
``.mypy_cache`` in the repository (git-ignored): a fresh clone checks from cold.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TIMEOUT_S = 900  # cold: about 70 s of CPU here; a busy 2-core machine took 8 minutes


def test_runtime_packages_type_check() -> None:
    command = [sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml")]
    done = subprocess.run(
        command, cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT_S, check=False
    )
    report = (done.stdout + done.stderr).strip()
    assert done.returncode == 0, f"expected mypy to pass, it exited {done.returncode}:\n{report}"
