"""``dsv3serve generate --tp-size 2 ...`` starts its own ranks and answers like one rank."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def _generate(model: Path, *layout: str) -> str:
    cmd = [sys.executable, "-m", "dsv3serve.cli", "generate", "--model", str(model)]
    cmd += ["--dtype", "float32", "--temperature", "0", "--max-new-tokens", "6"]
    cmd += ["--prompt", "hello", "--prompt", "a second prompt", *layout]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=True)
    return done.stdout


def test_generate_with_a_dp_attention_group_matches_one_rank(tiny_bf16_dir: Path) -> None:
    one = _generate(tiny_bf16_dir)
    group = _generate(
        tiny_bf16_dir, "--tp-size", "2", "--dp-size", "2", "--enable-dp-attention", "--ep-size", "2"
    )
    assert one.count("completion") == 2 and group == one


def test_an_impossible_layout_is_refused_naming_the_fields(tiny_bf16_dir: Path) -> None:
    cmd = [sys.executable, "-m", "dsv3serve.cli", "generate", "--model", str(tiny_bf16_dir)]
    cmd += ["--prompt", "x", "--tp-size", "2", "--dp-size", "2"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "dp_size 2 needs enable_dp_attention" in done.stderr
