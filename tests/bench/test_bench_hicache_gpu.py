"""The hierarchical cache's GPU benchmark runs on CPU (a smoke: its numbers are not a test)."""

from __future__ import annotations

import json
from pathlib import Path

from dsv3serve.bench.kv.hicache_gpu import main


def test_the_bandwidth_part_runs_and_writes_json(tmp_path: Path) -> None:
    out = tmp_path / "hicache.json"
    argv = ["--device", "cpu", "--out", str(out), "--skip-ttft", "--bw-pages", "4"]
    assert main([*argv, "--layers", "2", "--page-size", "16"]) == 0
    bandwidth = json.loads(out.read_text())["bandwidth"]
    assert bandwidth["pages"] == 4 and bandwidth["bytes"] == 4 * 2 * 16 * 576 * 2
    assert bandwidth["load_gbps"] > 0 and bandwidth["plain_h2d_gbps"] > 0
