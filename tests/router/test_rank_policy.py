"""router.routing.rank_policy: (replica, DP rank) choice by expected prefix hit and load (pure)."""

from __future__ import annotations

import pytest
from tier_util import NullCopier

from dsv3serve.engine.scheduler.scheduler import Scheduler, SchedulerConfig
from dsv3serve.kvcache.host_tier import HostTier
from dsv3serve.kvcache.manager import KVCacheManager
from dsv3serve.kvcache.prefix_hash import page_prefix_hashes
from router.routing.rank_policy import RankReport, RoutingWeights, rank_candidates
from workers.rank_report import rank_loads

PAGE = 16
PROMPT = list(range(100, 100 + 40 * PAGE + 5))  # 40 full pages and 5 tokens
HASHES = page_prefix_hashes(PROMPT, PAGE)


def rank(
    replica: int,
    dp_rank: int,
    load: int = 0,
    hit_pages: int = 0,
    free: int = 512,
    hashes: frozenset[int] | None = None,
) -> RankReport:
    cached = frozenset(HASHES[:hit_pages]) if hashes is None else hashes
    return RankReport(replica, dp_rank, free, 512, load, 0, cached)


def best(reports: list[RankReport], prompt: list[int] = PROMPT) -> tuple[int, int]:
    top = rank_candidates(reports, prompt, PAGE)[0]
    return top.replica, top.dp_rank


# (case, reports, expected best (replica, dp_rank)); default weights: a queued request
# costs 256 prompt tokens (16 pages), a full pool 1024
CASES = [
    ("idle ties go to the lowest id", [rank(1, 0), rank(0, 1), rank(0, 0)], (0, 0)),
    ("no hit: the less loaded rank", [rank(0, 0, load=3), rank(0, 1, load=1)], (0, 1)),
    # 640 hit tokens against 2 queued requests (512)
    ("a hit outweighs the load gap", [rank(0, 0, load=2, hit_pages=40), rank(0, 1)], (0, 0)),
    # ... but not against 3 (768), and 128 tokens not against 1 (256)
    ("a hit below the load gap loses", [rank(0, 0, load=3, hit_pages=40), rank(0, 1)], (0, 1)),
    ("a small hit does not count", [rank(0, 0, load=1, hit_pages=8), rank(0, 1)], (0, 1)),
    (
        "the longer hit wins at equal load",
        [rank(0, 0, hit_pages=4), rank(1, 1, hit_pages=9)],
        (1, 1),
    ),
    (
        "a hit where the prompt cannot fit loses",
        [rank(0, 0, hit_pages=40, free=0), rank(0, 1, load=5)],
        (0, 1),
    ),
    ("a fuller pool costs", [rank(0, 0, free=100), rank(0, 1, free=500)], (0, 1)),
    (
        "a deep prefix counts when the bounded summary lost the short ones",
        [rank(0, 0, load=1, hashes=frozenset({HASHES[29]})), rank(0, 1)],
        (0, 0),
    ),
]


@pytest.mark.parametrize(("case", "reports", "expected"), CASES, ids=[c[0] for c in CASES])
def test_policy_table(case: str, reports: list[RankReport], expected: tuple[int, int]) -> None:
    assert best(reports) == expected, case


def test_hits_are_full_pages_before_the_last_prompt_token() -> None:
    """A prompt of exactly 2 pages fully cached hits 1 page: its last token is computed."""
    prompt = PROMPT[: 2 * PAGE]
    cached = frozenset(page_prefix_hashes(prompt, PAGE))
    (top,) = rank_candidates([RankReport(0, 0, 10, 10, 0, 0, cached)], prompt, PAGE)
    assert top.hit_tokens == PAGE and top.fits


def test_salts_never_hit_each_other() -> None:
    cached = frozenset(page_prefix_hashes(PROMPT, PAGE, salt="tenant-a"))
    report = RankReport(0, 0, 512, 512, 0, 0, cached)
    assert rank_candidates([report], PROMPT, PAGE, salt="tenant-b")[0].hit_tokens == 0
    assert rank_candidates([report], PROMPT, PAGE, salt="tenant-a")[0].hit_tokens == 40 * PAGE


def test_weights_set_where_a_hit_outweighs_load() -> None:
    reports = [rank(0, 0, load=1, hit_pages=8), rank(0, 1)]  # 128 hit tokens vs 1 request
    assert best(reports) == (0, 1)
    cheap = RoutingWeights(tokens_per_request=100.0)
    assert rank_candidates(reports, PROMPT, PAGE, cheap)[0].dp_rank == 0


def test_a_real_caches_summary_predicts_its_own_hit() -> None:
    """The engine's summary (``KVCacheManager.prefix_hashes``) and the router's prompt
    hashes agree: the predicted hit is what ``peek_prefix`` finds."""
    kv = KVCacheManager(num_pages=64, page_size=PAGE)
    shared = PROMPT[: 12 * PAGE]
    pages = kv.allocate(12)
    assert pages is not None
    handle, _ = kv.insert_prefix(shared, pages, "", None)
    kv.release(handle, [])
    report = RankReport(0, 0, kv.available_pages, 64, 0, 0, frozenset(kv.prefix_hashes(64)))
    (top,) = rank_candidates([report], PROMPT, PAGE)
    assert top.hit_tokens == kv.peek_prefix(PROMPT, "", len(PROMPT) - 1) == 12 * PAGE


@pytest.mark.parametrize(
    "fields", [{"free_pages": 5, "num_pages": 4}, {"num_pages": 0}, {"running": -1}]
)
def test_bad_reports_are_refused(fields: dict[str, int]) -> None:
    args = {"replica": 0, "dp_rank": 0, "free_pages": 1, "num_pages": 4, "running": 0}
    with pytest.raises(ValueError, match="rank 0"):
        RankReport(**(args | fields), waiting=0)


def _tiered(replica: int, device_pages: int, host_pages: int, load: int = 0) -> RankReport:
    device = frozenset(HASHES[:device_pages])
    host = frozenset(HASHES[device_pages : device_pages + host_pages])
    return RankReport(replica, 0, 512, 512, load, 0, device, host)


def test_a_gpu_hit_beats_a_host_hit_beats_a_miss() -> None:
    gpu, host, miss = _tiered(2, 40, 0), _tiered(1, 0, 40), _tiered(0, 0, 0)
    assert [c.replica for c in rank_candidates([miss, host, gpu], PROMPT, PAGE)] == [2, 1, 0]
    (top,) = rank_candidates([host], PROMPT, PAGE)
    assert top.hit_tokens == 40 * PAGE, "a host hit is still a hit: nothing to compute"
    split = rank_candidates([_tiered(0, 10, 30)], PROMPT, PAGE)[0]
    assert split.hit_tokens == 40 * PAGE and split.score == (10 + 0.5 * 30) * PAGE


def test_host_hit_value_prices_a_host_hit_against_load() -> None:
    reports = [_tiered(0, 0, 40, load=2), _tiered(1, 0, 0)]  # 320 weighted tokens vs 512
    assert best(reports) == (1, 0)
    full = RoutingWeights(host_hit_value=1.0)  # 640 tokens: as a GPU hit, it wins
    assert rank_candidates(reports, PROMPT, PAGE, full)[0].replica == 0
    with pytest.raises(ValueError, match="host_hit_value"):
        RoutingWeights(host_hit_value=1.5)


def test_a_real_tiered_caches_summary_splits_device_and_host() -> None:
    """After eviction to the host tier the rank's summary lists the prefix as a host hit."""
    kv = KVCacheManager(num_pages=16, page_size=PAGE, host=HostTier(32, NullCopier()))
    pages = kv.allocate(12)
    assert pages is not None
    handle, _ = kv.insert_prefix(PROMPT[: 12 * PAGE], pages, "", None)
    kv.release(handle, [])
    assert kv.evict_all() == 12
    device, host = kv.prefix_hashes(64, True), kv.prefix_hashes(64, False)
    report = RankReport(0, 0, 16, 16, 0, 0, frozenset(device), frozenset(host))
    assert not device and len(host) == 12
    (top,) = rank_candidates([report], PROMPT, PAGE)
    assert top.hit_tokens == sum(kv.peek_prefix_tiers(PROMPT, "", len(PROMPT) - 1)) == 12 * PAGE


def test_a_replicas_rank_report_lists_host_only_prefixes_apart() -> None:
    """``workers.rank_report.rank_loads`` over a scheduler with a host tier: the evicted
    prefix moves from ``prefix_hashes`` to ``host_prefix_hashes``."""
    config = SchedulerConfig(page_size=PAGE, num_pages=16, num_host_pages=32)
    scheduler = Scheduler(config, NullCopier())
    pages = scheduler.kv.allocate(4)
    assert pages is not None
    handle, _ = scheduler.kv.insert_prefix(PROMPT[: 4 * PAGE], pages, "", None)
    scheduler.kv.release(handle, [])
    (before,) = rank_loads(scheduler)
    assert len(before.prefix_hashes) == 4 and before.host_prefix_hashes == []
    scheduler.kv.evict_all()
    (after,) = rank_loads(scheduler)
    assert after.prefix_hashes == [] and sorted(after.host_prefix_hashes) == sorted(
        before.prefix_hashes
    )
