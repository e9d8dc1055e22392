"""DPScheduler: one scheduler per DP rank behind the Scheduler interface (pure Python)."""

from __future__ import annotations

from dsv3serve.engine.scheduler.dp import DPScheduler
from dsv3serve.engine.scheduler.sequence import ScheduledBatch, SchedulerConfig, Sequence

PAGE = 4


def _sched(dp: int = 2, pages: int = 16) -> DPScheduler:
    return DPScheduler(SchedulerConfig(page_size=PAGE, num_pages=pages), dp)


def _seq(name: str, prompt: list[int], max_new: int = 4) -> Sequence:
    return Sequence(seq_id=f"{name}#0", prompt_ids=prompt, max_new_tokens=max_new)


def _run_to_end(s: DPScheduler, first_token: int = 5) -> None:
    """Drive every sequence to max_new_tokens, finishing them as the engine does."""
    while s.has_unfinished:
        batch = s.schedule()
        assert batch is not None
        s.on_step_done(batch, {item.seq_id: first_token for item in batch.sample_items})
        for item in batch.sample_items:
            seq = item.seq
            if len(seq.output_ids) >= seq.max_new_tokens:
                s.finish(seq, "length")
        s.check_invariants()


def test_new_sequences_spread_over_ranks_by_free_pages() -> None:
    s = _sched()
    a, b = _seq("a", list(range(1, 13))), _seq("b", list(range(20, 32)))
    s.add(a)
    batch = s.schedule()
    assert batch is not None
    s.on_step_done(batch, {"a#0": 5})
    s.add(b)  # rank 0 now holds a's pages: b goes to rank 1
    assert (a.dp_rank, b.dp_rank) == (0, 1)


def test_a_prefix_hit_wins_over_free_pages() -> None:
    s = _sched()
    prompt = list(range(1, 14))
    s.add(_seq("a", prompt))
    _run_to_end(s)
    # cached pages are evictable, so the ranks tie on available pages and the filler goes
    # to rank 0 by the load tie-break: the prefix hit must still pull "again" to rank 0
    s.add(_seq("filler", list(range(40, 52))))
    hit = _seq("again", prompt)
    s.add(hit)
    assert hit.dp_rank == 0
    _run_to_end(s)
    assert s.prefix_hit_tokens >= 12
    assert s.kv.used_pages == 0


def test_steps_route_items_to_their_rank_and_free_everything() -> None:
    s = _sched(dp=3)
    seqs = [_seq(f"s{i}", [i + 1] * (3 + i)) for i in range(6)]
    for seq in seqs:
        s.add(seq)
    assert sorted({seq.dp_rank for seq in seqs}) == [0, 1, 2]
    _run_to_end(s)
    assert all(len(seq.output_ids) == 4 for seq in seqs)
    assert s.kv.used_pages == 0 and s.num_running == 0


def test_reservations_are_global_pages_with_staging_on_rank_zero() -> None:
    s = _sched(pages=8)
    s.ranks[0].reserve(4 * PAGE)  # make rank 1 the emptier one
    pages = s.reserve(2 * PAGE)
    assert pages is not None and all(p >= s.pages_per_rank for p in pages)
    landing = s.landing_pages(pages)
    assert len(landing) == 2 and all(p < s.pages_per_rank for p in landing)
    used0 = s.ranks[0].kv.used_pages
    s.release_reservation(pages)
    assert s.ranks[1].kv.used_pages == 0 and s.ranks[0].kv.used_pages == used0 - 2


def test_a_prefilled_import_joins_its_rank() -> None:
    s = _sched(pages=8)
    s.ranks[0].reserve(4 * PAGE)
    pages = s.reserve(6)
    assert pages is not None
    staging = s.take_staging(pages)
    s.ranks[0].release_reservation(staging)
    seq = Sequence("p#0", [1, 2, 3, 4, 5, 6], 3, request_id="p", output_ids=[9])
    s.add_prefilled(seq, pages)
    assert seq.dp_rank == 1 and max(seq.page_table) < s.pages_per_rank
    batch = s.schedule()
    assert isinstance(batch, ScheduledBatch) and batch.items[0].seq is seq
    s.on_step_done(batch, {"p#0": 8})
    assert s.abort("p")
    s.check_invariants()
    assert s.ranks[1].kv.used_pages == 0


def test_a_prompt_reservation_goes_to_the_rank_holding_its_prefix() -> None:
    """Rank 1 caches the prompt's first 3 pages and has fewer available pages than rank 0:
    the reservation still lands there, locks those pages, and reserves (with rank 0
    staging) only the last page; releasing it gives back pages, staging and lock."""
    s = _sched(pages=8)
    prompt = list(range(1, 15))  # 14 tokens: 3 full pages + 2
    busy = s.ranks[0].reserve(4 * PAGE)  # make rank 1 the emptier one for the first request
    pages = s.reserve(len(prompt))
    assert busy is not None and pages is not None and s.split_pages(pages)[0] == 1
    s.ranks[0].release_reservation(s.take_staging(pages))
    s.ranks[0].release_reservation(busy)
    s.add_prefilled(Sequence("warm#0", prompt, 2, request_id="warm", output_ids=[9]), pages)
    _run_to_end(s)
    filler = s.ranks[1].reserve(2 * PAGE)
    assert s.ranks[0].kv.available_pages > s.ranks[1].kv.available_pages
    res = s.reserve_prompt(prompt)
    assert res is not None and res.num_cached_pages == 3 and res.num_cached_tokens == 12
    assert len(res.pages) == 1 and s.split_pages(res.pages)[0] == 1
    assert len(s.landing_pages(res.pages)) == 1  # staging on rank 0
    s.ranks[1].kv.evict_all()
    assert s.ranks[1].kv.peek_prefix(prompt, "", 13) == 12  # locked: not evicted
    s.release_prompt(res)
    s.ranks[1].release_reservation(filler)
    s.check_invariants()
    assert s.kv.used_pages == 0


def test_a_routers_rank_is_honoured_for_new_sequences_unless_invalid_or_full() -> None:
    """``preferred_dp_rank`` beats the scheduler's own choice (rank 0 on a tie); a rank
    that does not exist, or cannot hold the prompt, falls back and is counted."""
    s = _sched(pages=4)
    chosen = Sequence("r1#0", list(range(1, 9)), 2, preferred_dp_rank=1)
    s.add(chosen)
    assert chosen.dp_rank == 1 and s.placed == [0, 1] and s.fallbacks == [0, 0]
    invalid = Sequence("r7#0", list(range(20, 28)), 2, preferred_dp_rank=7)
    s.add(invalid)
    assert invalid.dp_rank == 0 and s.fallbacks == [1, 0]
    full = s.ranks[1].reserve(4 * PAGE)  # rank 1 has no page left
    assert full is not None
    too_big = Sequence("f#0", list(range(40, 46)), 2, preferred_dp_rank=1)
    s.add(too_big)
    assert too_big.dp_rank == 0 and s.placed == [2, 1] and s.fallbacks == [2, 0]
    s.ranks[1].release_reservation(full)
    _run_to_end(s)
    assert s.kv.used_pages == 0


def test_a_prompt_reservation_honours_the_routers_rank_over_the_prefix() -> None:
    """Rank 0 caches the prompt, but the router named rank 1 (its own trade-off): the
    reservation lands on rank 1 (nothing cached there); a full rank falls back."""
    s = _sched(pages=8)
    prompt = list(range(1, 15))
    s.add(_seq("warm", prompt))
    _run_to_end(s)
    res = s.reserve_prompt(prompt, dp_rank=1)
    assert res is not None and s.split_pages(res.pages)[0] == 1
    assert res.num_cached_pages == 0 and s.fallbacks == [0, 0]
    s.release_prompt(res)
    hold = s.ranks[1].reserve(8 * PAGE)
    assert hold is not None
    back = s.reserve_prompt(prompt, dp_rank=1)
    assert back is not None and s.split_pages(back.pages)[0] == 0
    assert back.num_cached_pages == 3 and s.fallbacks == [1, 0]
    s.release_prompt(back)
    s.ranks[1].release_reservation(hold)
    s.check_invariants()
    assert s.kv.used_pages == 0
