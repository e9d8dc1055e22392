"""Warm starts: the compile caches pointed into the cache dir, the ``--cache-dir`` flag, and
``dsv3serve warmup`` run as a real process on the tiny model (CPU: no Triton or flashinfer
compile happens here, so what lands in the cache dir is ours: the warm-up record)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dsv3serve.cli import build_parser
from dsv3serve.engine.warmup import record_path, warmup_prompt
from dsv3serve.settings import CACHE_ENV, COMPILE_CACHE_ENV, export_compile_caches

ROOT = Path(__file__).resolve().parents[2]


def test_compile_caches_go_under_the_cache_dir(tmp_path: Path) -> None:
    env: dict[str, str] = {"TRITON_CACHE_DIR": "/elsewhere/triton"}  # set by hand: kept
    got = export_compile_caches(tmp_path, env)
    assert env[CACHE_ENV] == str(tmp_path)
    assert got["TRITON_CACHE_DIR"] == "/elsewhere/triton"
    for name, sub in COMPILE_CACHE_ENV.items():
        if name != "TRITON_CACHE_DIR":
            assert env[name] == str(tmp_path / sub), name


def test_cache_dir_defaults_to_the_env_or_home(tmp_path: Path) -> None:
    env = {CACHE_ENV: str(tmp_path)}
    assert export_compile_caches(None, env)["TVM_FFI_CACHE_DIR"] == str(tmp_path / "tvm-ffi")
    home = export_compile_caches(None, {})
    assert home["TRITON_CACHE_DIR"] == str(Path.home() / ".cache" / "dsv3serve" / "triton")


@pytest.mark.parametrize("command", [["warmup"], ["generate", "--prompt", "hi"], ["serve"]])
def test_cli_takes_cache_dir(command: list[str], tmp_path: Path) -> None:
    args = build_parser().parse_args([*command, "--cache-dir", str(tmp_path)])
    assert args.cache_dir == tmp_path


def test_warmup_parses_its_flags() -> None:
    args = build_parser().parse_args(["warmup", "--model", "tiny", "--prompt-len", "9"])
    assert (args.prompt_len, args.max_new_tokens, args.func.__name__) == (9, 4, "_cmd_warmup")


def test_warmup_prompt_is_fixed_and_ordinary() -> None:
    ids = warmup_prompt(50, 129280)
    assert ids == warmup_prompt(50, 129280) and all(2 <= i < 128000 for i in ids)
    assert all(2 <= i < 300 for i in warmup_prompt(50, 300))


def test_warmup_process_fills_the_cache_dir(tiny_fp8_dir: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    env = {k: v for k, v in os.environ.items() if k not in COMPILE_CACHE_ENV}
    env["PYTHONPATH"] = str(ROOT)
    cmd = [sys.executable, "-m", "dsv3serve.cli", "warmup", "--model", str(tiny_fp8_dir)]
    cmd += ["--cache-dir", str(cache), "--prompt-len", "12", "--max-new-tokens", "3"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["tokens"] == 3 and result["first_token_unix"] is not None
    assert result["compile_caches"]["TRITON_CACHE_DIR"] == str(cache / "triton")
    record = record_path(cache, str(tiny_fp8_dir))
    assert result["record"] == str(record) and json.loads(record.read_text())["tokens"] == 3
