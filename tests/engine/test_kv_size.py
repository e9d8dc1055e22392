"""A rank's KV pool size from the engine config: explicit, the CPU rule, the GPU budget; on CPU
never a share of the host's free memory."""

from __future__ import annotations

import builtins
import io
import os
from types import SimpleNamespace
from typing import Any

import psutil
import pytest
import torch
from engine_util import make_engine

from dsv3serve.cli import build_parser
from dsv3serve.config import ModelConfig
from dsv3serve.engine.config import EngineConfig
from dsv3serve.engine.kv_size import agreed_size, context_len, rank_kv_size
from dsv3serve.kvcache.sizing import GIB, cuda_kv_budget_bytes
from dsv3serve.model.tiny import TINY_CONFIG

TINY = ModelConfig.from_dict(TINY_CONFIG)  # context 163,840 tokens
PAGE_BYTES = 25_600  # 5 KV layers x 16 tokens x 80 values x 4 B (float32)
CPU = torch.device("cpu")
# engine fields -> (pages, the reason's start)
CASES = [
    ({}, (4 * GIB // PAGE_BYTES, "capped at 4 GiB (cpu_kv_cache_space_gib)")),
    ({"max_running_requests": 4, "max_model_len": 2048}, (512, "requests x context: 4 x 2048")),
    ({"max_running_requests": 2}, (2 * 10_240, "requests x context: 2 x 163840")),
    ({"max_running_requests": 4, "max_model_len": 100}, (4 * 7, "requests x context: 4 x 100")),
    ({"cpu_kv_cache_space_gib": 0.25}, (GIB // 4 // PAGE_BYTES, "capped at 0.25 GiB")),
    ({"num_kv_tokens": 1000}, (63, "num_kv_tokens 1000")),
    ({"num_kv_tokens": 1000, "max_running_requests": 1}, (63, "num_kv_tokens 1000")),
]


def _no_reserve() -> int:
    raise AssertionError("the GPU's reserves are asked for on CPU")


def _size(scratch: int = 0, device: torch.device = CPU, **fields: Any) -> Any:
    cfg = EngineConfig(model="tiny", **fields)
    return rank_kv_size(cfg, TINY, device, PAGE_BYTES, scratch, _no_reserve)


@pytest.mark.parametrize(("fields", "expected"), CASES)
def test_cpu_pool_by_the_rule(fields: dict[str, Any], expected: tuple[int, str]) -> None:
    size = _size(**fields)
    assert (size.pages, size.page_size, size.page_bytes) == (expected[0], 16, PAGE_BYTES)
    assert size.reason.startswith(expected[1]), size.reason


def test_scratch_pages_come_on_top_and_are_named() -> None:
    size = _size(scratch=1, max_running_requests=4, max_model_len=2048)
    assert size.pages == 513 and size.reason.endswith("; + 1 scratch pages")
    assert _size(scratch=1, num_kv_tokens=1000).pages == 64


def test_context_is_max_model_len_else_the_models() -> None:
    assert context_len(EngineConfig(model="tiny"), TINY) == 163_840
    assert context_len(EngineConfig(model="tiny", max_model_len=300), TINY) == 300


def test_a_smaller_group_agreement_is_said() -> None:
    own = _size(max_running_requests=4, max_model_len=2048)
    assert agreed_size(own, own.pages) is own
    less = agreed_size(own, 100)
    assert less.pages == 100 and less.reason.endswith("the group's smallest pool")


def test_gpu_budget_is_unchanged(monkeypatch: pytest.MonkeyPatch) -> None:
    """No GPU here: the device's memory is faked; the budget is SGLang's, as before."""
    gb = 10**9
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda _device: (40 * gb, 150 * gb))
    cfg = EngineConfig(model="tiny", device="cuda")
    size = rank_kv_size(cfg, TINY, torch.device("cuda", 0), PAGE_BYTES, 1, lambda: 8 * gb)
    assert size.pages == cuda_kv_budget_bytes(40 * gb, 150 * gb, 0.85, 8 * gb) // PAGE_BYTES
    assert size.reason.startswith("mem_fraction_static 0.85")


def fake_host_memory(monkeypatch: pytest.MonkeyPatch, available: int) -> None:
    """Every source the old CPU sizing read free memory from says ``available`` bytes:
    psutil, ``/proc/meminfo`` MemAvailable and ``os.sysconf``."""
    vm = SimpleNamespace(available=available, free=available, total=available)
    monkeypatch.setattr(psutil, "virtual_memory", lambda: vm)
    real_sysconf, real_open = os.sysconf, builtins.open

    def sysconf(name: str | int) -> int:
        pages = {"SC_AVPHYS_PAGES": available // 4096, "SC_PHYS_PAGES": available // 4096}
        return pages[name] if name in pages else real_sysconf(name)

    def fake_open(file: Any, *args: Any, **kwargs: Any) -> Any:
        if str(file) == "/proc/meminfo":
            kb = available // 1024
            return io.StringIO(f"MemTotal: {kb} kB\nMemFree: {kb} kB\nMemAvailable: {kb} kB\n")
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(os, "sysconf", sysconf)
    monkeypatch.setattr(builtins, "open", fake_open)
    monkeypatch.setattr(io, "open", fake_open)


@pytest.mark.parametrize("available", [1 << 20, 1 << 50], ids=["1MiB", "1PiB"])
def test_cpu_size_never_depends_on_host_free_memory(
    monkeypatch: pytest.MonkeyPatch, available: int
) -> None:
    fake_host_memory(monkeypatch, available)
    for fields, (pages, _reason) in CASES:
        assert _size(**fields).pages == pages, fields


@pytest.mark.parametrize("available", [64 << 20, 1 << 50], ids=["64MiB", "1PiB"])
def test_engine_pool_never_depends_on_host_free_memory(
    monkeypatch: pytest.MonkeyPatch, available: int
) -> None:
    """A whole engine on a host that claims ``available`` bytes free: the pool is the rule's,
    2 requests of 256 tokens in pages of 4 (the old default took 0.85 of the claim)."""
    fake_host_memory(monkeypatch, available)
    engine = make_engine(num_kv_tokens=None, max_running_requests=2, max_model_len=256)
    assert engine.runner.kv_size.reason == "requests x context: 2 x 256 tokens"
    assert engine.runner.pool.num_pages == engine.runner.num_pages == 2 * 64


def test_the_cap_is_an_engine_flag() -> None:
    command = ["generate", "--prompt", "x"]
    given = build_parser().parse_args([*command, "--cpu-kv-cache-space-gib", "1.5"])
    assert EngineConfig.from_args(given).cpu_kv_cache_space_gib == 1.5
    assert EngineConfig.from_args(build_parser().parse_args(command)).cpu_kv_cache_space_gib == 4
