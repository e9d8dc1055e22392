"""``dsv3serve bench one-batch`` end to end on CPU, on tiny checkpoints."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from dsv3serve.cli import main
from dsv3serve.model.tiny import make_tiny_checkpoint

SMALL_VOCAB = 403  # smaller than the 128000 ordinary ids the bench used to draw from


def _run(model: Path, out: Path) -> dict[str, Any]:
    argv = ["bench", "one-batch", "--model", str(model), "--load-format", "dummy"]
    argv += ["--batch-size", "1", "2", "--input-len", "8", "--output-len", "3"]
    assert main([*argv, "--json", str(out)]) == 0
    return json.loads(out.read_text())


def test_one_batch_on_a_small_vocabulary(tmp_path: Path) -> None:
    model = make_tiny_checkpoint(tmp_path / "ckpt", overrides={"vocab_size": SMALL_VOCAB})
    result = _run(model, tmp_path / "one_batch.json")
    rows = result["results"]
    assert [(r["batch_size"], r["input_len"]) for r in rows] == [(1, 8), (2, 8)]
    assert all(r["prefill_latency_s"] > 0 and r["total_throughput_tok_s"] > 0 for r in rows)
    assert result["meta"]["model"] == str(model)
