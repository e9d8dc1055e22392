"""Where a request should run: scoring (replica, DP rank) candidates from the ranks' own
reports, for prefill and for decode (pure: no I/O, no torch).

Each DP rank of each replica reports its free KV pages, running and waiting requests, and
a bounded set of hashes of the page-aligned prefixes its prefix cache holds
(``dsv3serve.kvcache.prefix_hash``). A candidate's score is in prompt tokens:

    score = device hit tokens + host_hit_value * host-tier hit tokens
            - tokens_per_request * (running + waiting)
            - tokens_per_pool * (fraction of the pool in use)

The hit is what the rank would not compute (prefill) or not pull (decode); a hit in the
hierarchical cache's host tier (``host_prefix_hashes``) is worth less (the rank loads it
back into device pages first), so a GPU hit beats a host hit beats a miss; the load terms
price a queued request and a full pool in the same unit, so a cache hit outweighs a load
gap exactly when it saves more tokens than the gap costs. A rank without free pages for
the prompt's missing pages is ranked after every rank with room. Ties go to the lowest
(replica, rank), so every router replica orders candidates the same way.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from dsv3serve.kvcache.prefix_hash import page_prefix_hashes


@dataclass(frozen=True)
class RankReport:
    """What one DP rank of one replica last reported.

    ``free_pages``: pages an allocation can get now (free plus evictable cached pages, as
    ``WorkerLoad.free_pages``); ``prefix_hashes``: its prefix cache's summary of prefixes
    in device pages (``KVCacheManager.prefix_hashes``), ``host_prefix_hashes`` of those
    only in its host tier.
    """

    replica: int
    dp_rank: int
    free_pages: int
    num_pages: int
    running: int
    waiting: int
    prefix_hashes: frozenset[int] = frozenset()
    host_prefix_hashes: frozenset[int] = frozenset()

    def __post_init__(self) -> None:
        if self.num_pages <= 0 or not 0 <= self.free_pages <= self.num_pages:
            raise ValueError(
                f"replica {self.replica} rank {self.dp_rank}: expected 0 <= free_pages <= "
                f"num_pages and num_pages > 0, found {self.free_pages} of {self.num_pages}"
            )
        if self.running < 0 or self.waiting < 0:
            raise ValueError(f"replica {self.replica} rank {self.dp_rank}: negative counts")


@dataclass(frozen=True)
class RoutingWeights:
    """Prices of load, in prompt tokens (see the module docstring)."""

    tokens_per_request: float = 256.0
    tokens_per_pool: float = 1024.0
    host_hit_value: float = 0.5  # a host-tier hit token, in device hit tokens

    def __post_init__(self) -> None:
        if self.tokens_per_request < 0 or self.tokens_per_pool < 0:
            raise ValueError(f"routing weights must be >= 0, got {self}")
        if not 0 <= self.host_hit_value <= 1:
            raise ValueError(f"host_hit_value must be in [0, 1], got {self.host_hit_value}")


@dataclass(frozen=True)
class Candidate:
    """One scored (replica, DP rank)."""

    replica: int
    dp_rank: int
    hit_tokens: int
    fits: bool
    score: float


def cached_pages(report: RankReport, prompt_hashes: Sequence[int], host: bool = False) -> int:
    """Leading prompt pages ``report``'s cache holds in device pages (with ``host``: in
    either tier): the longest prefix whose hash it lists (a listed deep prefix counts even
    when the bounded summary dropped shorter ones)."""
    for num_pages in range(len(prompt_hashes), 0, -1):
        h = prompt_hashes[num_pages - 1]
        if h in report.prefix_hashes or (host and h in report.host_prefix_hashes):
            return num_pages
    return 0


def score_rank(
    report: RankReport,
    prompt_hashes: Sequence[int],
    prompt_pages: int,
    page_size: int,
    weights: RoutingWeights,
) -> Candidate:
    """Score ``report`` for a prompt of ``prompt_pages`` pages whose matchable full pages
    hash to ``prompt_hashes``."""
    device_pages = cached_pages(report, prompt_hashes)
    host_pages = cached_pages(report, prompt_hashes, host=True) - device_pages
    hit = (device_pages + weights.host_hit_value * host_pages) * page_size
    used = 1.0 - report.free_pages / report.num_pages
    load = weights.tokens_per_request * (report.running + report.waiting)
    score = hit - load - weights.tokens_per_pool * used
    fits = prompt_pages - device_pages <= report.free_pages  # host pages need device pages
    hit_tokens = (device_pages + host_pages) * page_size
    return Candidate(report.replica, report.dp_rank, hit_tokens, fits, score)


def rank_candidates(
    reports: Sequence[RankReport],
    prompt_ids: Sequence[int],
    page_size: int,
    weights: RoutingWeights | None = None,
    salt: str = "",
) -> list[Candidate]:
    """Every reported (replica, DP rank), best first, for ``prompt_ids``.

    As the engines match, the prompt's last token is never counted as a hit (it is always
    computed), so at most ``len(prompt_ids) - 1`` tokens, in full pages, can hit.
    """
    weights = RoutingWeights() if weights is None else weights
    hashes = page_prefix_hashes(prompt_ids[: len(prompt_ids) - 1], page_size, salt)
    prompt_pages = -(-len(prompt_ids) // page_size)
    scored = [score_rank(r, hashes, prompt_pages, page_size, weights) for r in reports]
    return sorted(scored, key=lambda c: (not c.fits, -c.score, c.replica, c.dp_rank))
