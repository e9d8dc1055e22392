"""``benchmarks/control_group_check.py`` on CPU: two gloo ranks joined by ``init_group`` carry
commands over the control group and tensors over the default group, in order, round after
round (the same wire a GPU group uses beside NCCL)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_commands_and_device_tensors_arrive_in_order() -> None:
    cmd = [sys.executable, "benchmarks/control_group_check.py", "--device", "cpu",
           "--rounds", "20"]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["rounds"] == 20 and result["us"] > 0
    assert result["per_round"].endswith("+ 64 ids")
