"""``dsv3serve plan --device cpu``: each rank's KV pool by the engine's CPU rule, and why."""

from __future__ import annotations

import argparse
import json

import pytest

from dsv3serve.config import ModelConfig
from dsv3serve.kvcache.sizing import GIB
from dsv3serve.model.tiny import TINY_CONFIG
from dsv3serve.parallel.config import ParallelConfig
from dsv3serve.plan.cli import add_plan_parser
from dsv3serve.plan.cpu import CpuSettings, cpu_plan, cpu_plan_table

TINY = ModelConfig.from_dict(TINY_CONFIG)
DP2_EP2 = ParallelConfig(tp_size=2, dp_size=2, enable_dp_attention=True, ep_size=2)


@pytest.mark.parametrize(
    ("parallel", "settings", "page_bytes", "pages", "reason"),
    [
        (ParallelConfig(), CpuSettings(), 25_600, 4 * GIB // 25_600, "capped at 4 GiB"),
        (DP2_EP2, CpuSettings(), 25_600, 2 * GIB // 25_600, "capped at 2 GiB: cpu_kv_cache"),
        (
            ParallelConfig(),
            CpuSettings(max_running_requests=4, max_model_len=2048),
            25_600,
            512,
            "requests x context",
        ),
        (
            ParallelConfig(),
            CpuSettings(dtype="bfloat16", page_size=64),
            5 * 64 * 80 * 2,
            4 * GIB // (5 * 64 * 80 * 2),
            "capped at 4 GiB",
        ),
        (
            ParallelConfig(),
            CpuSettings(kv_cache_dtype="fp8_e4m3", max_running_requests=1, max_model_len=64),
            5 * 16 * (80 + 4),
            4,
            "requests x context: 1 x 64",
        ),
    ],
    ids=["one_rank", "dp2_ep2", "small_demand", "bf16_page64", "fp8"],
)
def test_cpu_plan_uses_the_engines_rule(
    parallel: ParallelConfig, settings: CpuSettings, page_bytes: int, pages: int, reason: str
) -> None:
    kv = cpu_plan(TINY, parallel, settings).kv
    assert (kv.pages, kv.page_bytes) == (pages, page_bytes)
    assert kv.reason.startswith(reason), kv.reason


def test_cpu_table_says_pages_tokens_bytes_and_why() -> None:
    table = cpu_plan_table(cpu_plan(TINY, DP2_EP2, CpuSettings()), "tiny")
    assert "2 ranks on one host (CPU)" in table
    assert (
        "KV pool per rank: 83886 pages of 16 tokens = 1342176 tokens, 2147481600 bytes "
        "(2.00 GiB): capped at 2 GiB: cpu_kv_cache_space_gib 4 shared by 2 ranks on this host"
    ) in table


def _plan_cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """``dsv3serve plan`` in this process (its parser and command): exit code, out, err."""
    parser = argparse.ArgumentParser()
    add_plan_parser(parser.add_subparsers())
    parsed = parser.parse_args(["plan", *args])
    code = parsed.func(parsed)
    out = capsys.readouterr()
    return code, out.out, out.err


def test_cli_cpu_plan_json_and_the_gpu_size_it_still_needs(
    capsys: pytest.CaptureFixture[str],
) -> None:
    layout = ("--model", "tiny", "--tp-size", "2", "--dp-size", "2", "--enable-dp-attention")
    code, out, err = _plan_cli(capsys, *layout, "--ep-size", "2", "--device", "cpu", "--json")
    assert code == 0, err
    data = json.loads(out)
    assert (data["kv_pages"], data["kv_bytes"]) == (83886, 83886 * 25_600)
    assert data["kv_reason"].startswith("capped at 2 GiB")
    code, _out, err = _plan_cli(capsys, *layout, "--ep-size", "2")
    assert code == 2 and "--gpu-memory-gb is required" in err
