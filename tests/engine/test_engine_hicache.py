"""The hierarchical cache in the offline engine on the tiny model (CPU): a host tier of
real host tensors (``HostKVPool``) under a device pool the prefixes overflow."""

from __future__ import annotations

import pytest
import torch
from engine_util import GREEDY, drain, make_engine, prompts
from prometheus_client import CollectorRegistry, generate_latest
from tier_util import NullCopier

from dsv3serve.cli import build_parser
from dsv3serve.engine.config import EngineConfig
from dsv3serve.engine.engine import Engine
from dsv3serve.engine.request import Request
from dsv3serve.kvcache.host_pool import page_runs
from dsv3serve.kvcache.host_tier import HostTier
from dsv3serve.metrics import EngineState, EngineStateCollector, Identity, with_tier_state

# 24 pages of 4 tokens; 6 conversations of a 32-token prefix need 48 and more
POOL = {"num_kv_tokens": 96, "chunked_prefill_size": 16, "max_num_batched_tokens": 32}
HICACHE = {"enable_hierarchical_cache": True, "hicache_ratio": 3.0}


def _two_passes(engine: Engine) -> tuple[dict[str, list[int]], int]:
    """Two passes over 6 prefixes (new suffixes the second time), one request at a time:
    every output and the prefill tokens the second pass computed."""
    prefixes = prompts(6, seed=11, lo=32, hi=32)
    results: dict[str, list[int]] = {}
    for turn, suffix in enumerate(([5, 6], [7, 8, 9])):
        if turn == 1:
            before = engine.scheduler.num_prefill_tokens
        for i, prefix in enumerate(prefixes):
            engine.add_request(Request(f"t{turn}-{i}", GREEDY, prompt_ids=prefix + suffix))
            drain(engine, results)
            engine.scheduler.check_invariants()
    return results, engine.scheduler.num_prefill_tokens - before


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlap"])
def test_host_tier_keeps_greedy_tokens_and_saves_80_percent_of_the_second_prefill(
    overlap: bool,
) -> None:
    loop = {"force_overlap_schedule": overlap}
    off_outputs, off_tokens = _two_passes(make_engine(**POOL, **loop))
    engine = make_engine(**POOL, **HICACHE, **loop)
    on_outputs, on_tokens = _two_passes(engine)
    assert on_outputs == off_outputs
    assert on_tokens <= 0.2 * off_tokens, (on_tokens, off_tokens)
    state = engine.engine_state()
    assert state.host_hits > 0 and state.host_loaded_pages > 0
    assert state.host_load_seconds > 0 and state.host_pages == engine.host_pool.num_pages


def test_host_pool_pages_round_trip_bit_exact() -> None:
    engine = make_engine(**POOL, **HICACHE)
    pool, host = engine.runner.pool, engine.host_pool
    assert host is not None
    for layer in range(pool.num_layers):
        pool.kv_buffer(layer).copy_(torch.randn_like(pool.kv_buffer(layer).float()))
    before = [pool.kv_buffer(layer)[[3, 4, 2]].clone() for layer in range(pool.num_layers)]
    host.backup([3, 4, 2], [7, 8, 0])  # a run of two pages, then one
    for layer in range(pool.num_layers):
        pool.kv_buffer(layer)[2:5].fill_(0)
    host.load([0, 7, 8], [9, 5, 6])
    for layer in range(pool.num_layers):
        assert pool.kv_buffer(layer)[5].equal(before[layer][0])
        assert pool.kv_buffer(layer)[6].equal(before[layer][1])
        assert pool.kv_buffer(layer)[9].equal(before[layer][2])


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"hicache_ratio": 2.0}, "set enable_hierarchical_cache"),
        ({**HICACHE, "hicache_size": 1}, "found both"),
        ({**HICACHE, "enable_prefix_caching": False}, "prefix caching disabled"),
        ({**HICACHE, "hicache_ratio": 0}, "greater than 0"),
    ],
)
def test_hicache_config_is_validated(fields: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EngineConfig(model="tiny", **fields)


def test_hicache_size_sets_the_host_pages_by_bytes() -> None:
    cfg = EngineConfig(model="tiny", enable_hierarchical_cache=True, hicache_size=2)
    assert cfg.host_tier_pages(100, 10**6) == 2000
    ratio = EngineConfig(model="tiny", enable_hierarchical_cache=True)
    assert ratio.host_tier_pages(100, 10**6) == 200
    assert EngineConfig(model="tiny").host_tier_pages(100, 10**6) == 0


def test_host_tier_counters_are_exposed_to_prometheus() -> None:
    tier = HostTier(8, NullCopier())
    tier.stats.hit_tokens, tier.stats.loaded_pages, tier.stats.load_seconds = 64, 4, 0.25
    assert tier.alloc() is not None
    state = with_tier_state(EngineState(0, 0, 0.0, 100, 80, 0, prefill_tokens=20), tier)
    registry = CollectorRegistry()
    registry.register(EngineStateCollector(Identity("prefill", "0", "tiny"), lambda: state))
    text = generate_latest(registry).decode()
    for line in (
        "dsv3serve:prefix_cache_host_hits_total",
        "dsv3serve:hicache_loaded_pages_total",
        "dsv3serve:hicache_load_seconds_total",
        "dsv3serve:prefill_tokens_computed_total",
        "dsv3serve:hicache_host_used_pages",
    ):
        assert any(row.startswith(line + "{") for row in text.splitlines()), line
    assert 'hicache_host_pages{dp_rank="0",model="tiny",replica="0",role="prefill"} 8.0' in text


def test_page_runs_coalesce_pages_consecutive_on_both_sides() -> None:
    assert page_runs([3, 4, 5, 9, 10], [7, 8, 9, 1, 2]) == [(3, 7, 3), (9, 1, 2)]
    assert page_runs([1, 2], [5, 4]) == [(1, 5, 1), (2, 4, 1)]
    assert page_runs([], []) == []


def test_cli_flags_set_the_hicache_fields() -> None:
    argv = ["generate", "--prompt", "x", "--enable-hierarchical-cache", "--hicache-size", "3"]
    cfg = EngineConfig.from_args(build_parser().parse_args(argv))
    assert cfg.enable_hierarchical_cache and cfg.hicache_size == 3 and cfg.hicache_ratio is None
    plain = EngineConfig.from_args(build_parser().parse_args(["generate", "--prompt", "x"]))
    assert not plain.enable_hierarchical_cache
    with pytest.raises(ValueError, match="set enable_hierarchical_cache"):
        EngineConfig.from_args(build_parser().parse_args([*argv[:3], "--hicache-ratio", "2"]))
