"""Disaggregation hooks: prefill-only export on one engine, import and decode on another."""

from __future__ import annotations

from engine_util import GREEDY, drain, make_engine, prompts, run_alone

from dsv3serve.engine.engine import Engine, KVReservation
from dsv3serve.engine.request import Request, TokenOutput


def test_prefill_export_then_decode_import_equals_colocated() -> None:
    prefill, decode = make_engine(), make_engine()
    colocated = make_engine()
    for i, ids in enumerate(prompts(3, seed=31, lo=5, hi=30)):
        rid = f"pd{i}"
        pages = decode.reserve_kv(len(ids))
        assert pages is not None
        prefill.add_request(Request(rid, GREEDY, prompt_ids=ids), prefill_only=True)
        first = drain(prefill)[rid]
        export = prefill.export_kv(rid)
        assert len(first) == 1 and export.first_token == first[0]
        kv = prefill.runner.read_pages(export.pages)
        decode.runner.write_pages(pages[: len(export.pages)], kv)
        prefill.release_export(rid)
        decode.import_kv(Request(rid, GREEDY, prompt_ids=ids), export.first_token, pages)
        streamed = drain(decode)[rid]  # the decode stream re-emits the first token
        assert streamed[0] == first[0]
        assert streamed == run_alone(colocated, ids)
    for engine in (prefill, decode):
        engine.scheduler.kv.evict_all()
        assert engine.scheduler.kv.free_pages == engine.scheduler.kv.num_pages


def test_unused_reservation_and_abort_of_exported_request_free_pages() -> None:
    prefill, decode = make_engine(), make_engine()
    pages = decode.reserve_kv(20)
    assert pages is not None and decode.scheduler.kv.used_pages == len(pages)
    decode.release_reservation(pages)
    prefill.add_request(Request("x", GREEDY, prompt_ids=prompts(1, seed=3)[0]), prefill_only=True)
    drain(prefill)
    assert prefill.export_kv("x").pages
    assert prefill.abort("x")
    for engine in (prefill, decode):
        engine.scheduler.kv.evict_all()
        assert engine.scheduler.kv.free_pages == engine.scheduler.kv.num_pages


def test_release_of_a_request_still_prefilling_touches_nothing() -> None:
    """The release-vs-retry race, on the engine: a release that names a request still
    prefilling (the router's late release of an earlier try, landing on a retry of the same
    id) must not pull its state out from under the next step (a KeyError in sampling
    killed the engine loop). It is a no-op; the request prefills and exports as usual."""
    engine = make_engine(chunked_prefill_size=8)
    ids = prompts(1, seed=3, lo=30, hi=30)[0]
    engine.add_request(Request("r", GREEDY, prompt_ids=ids), prefill_only=True)
    assert engine.step() == []  # the first of four prompt chunks
    assert engine.release_export("r") is False
    assert engine.release_export("never-seen") is False
    first = drain(engine)["r"]
    assert first == run_alone(make_engine(), ids)[:1]
    assert engine.has_export("r") and engine.release_export("r") is True
    assert engine.release_export("r") is False  # idempotent
    engine.scheduler.kv.evict_all()
    assert engine.scheduler.kv.free_pages == engine.scheduler.kv.num_pages
    assert engine.num_live_sequences == 0


# ---- decode-side prefix reuse ----------------------------------------------------------
def pd_pull(
    prefill: Engine, decode: Engine, rid: str, ids: list[int], reuse: bool = True
) -> tuple[list[TokenOutput], int]:
    """One PD request as the worker hosts run it: reserve on ``decode`` (after its cached
    prefix with ``reuse``), prefill, copy only the pages the reservation misses, import.
    Returns the decode outputs and the number of pages copied."""
    res = decode.reserve_prompt_kv(ids) if reuse else KVReservation(decode.reserve_kv(len(ids)))
    assert res is not None and res.pages is not None
    prefill.add_request(Request(rid, GREEDY, prompt_ids=ids), prefill_only=True)
    (first,) = [out for out in prefill.step() if out.request_id == rid]
    export = prefill.export_kv(rid)
    missing = export.pages[res.num_cached_pages : len(export.pages)]
    assert len(missing) == len(res.pages)
    decode.runner.write_pages(res.pages, prefill.runner.read_pages(missing))
    prefill.release_export(rid)
    decode.import_kv(
        Request(rid, GREEDY, prompt_ids=ids),
        export.first_token,
        res.pages,
        prefix=res.prefix,
        cached_tokens=first.cached_tokens,
    )
    outputs: list[TokenOutput] = []
    while decode.has_unfinished():
        outputs.extend(decode.step())
    return outputs, len(missing)


def tokens(outputs: list[TokenOutput]) -> list[int]:
    return [t for out in outputs for t in out.token_ids]


def test_decode_with_a_cached_prefix_pulls_only_the_missing_pages() -> None:
    """The second prompt shares 26 tokens (6 full pages of 4) with the first: the decode
    side that served the first locks those pages, is sent only the other 3, and streams the
    same greedy tokens as a decode engine that pulled all 9."""
    prefill, decode, full = make_engine(), make_engine(), make_engine()
    shared = prompts(1, seed=51, lo=26, hi=26)[0]
    first_ids = shared + prompts(1, seed=52, lo=6, hi=6)[0]
    second_ids = shared + prompts(1, seed=53, lo=8, hi=8)[0]
    _, moved = pd_pull(prefill, decode, "one", first_ids)
    assert moved == 8  # nothing cached on decode yet
    out, moved = pd_pull(prefill, decode, "two", second_ids)
    expected, moved_full = pd_pull(make_engine(), full, "two", second_ids, reuse=False)
    assert (moved, moved_full) == (3, 9)
    assert tokens(out) == tokens(expected) == run_alone(make_engine(), second_ids)
    # the prefill side hit its own cache for the 6 shared pages: that is cached_tokens
    assert {o.cached_tokens for o in out} == {24} and {o.cached_tokens for o in expected} == {0}
    for engine in (prefill, decode, full):
        engine.scheduler.check_invariants()
        engine.scheduler.kv.evict_all()
        assert engine.scheduler.kv.free_pages == engine.scheduler.kv.num_pages


def test_a_reserved_prefix_survives_eviction_until_released() -> None:
    prefill, decode = make_engine(), make_engine()
    ids = prompts(1, seed=54, lo=30, hi=30)[0]
    pd_pull(prefill, decode, "warm", ids)
    kv = decode.scheduler.kv
    res = decode.reserve_prompt_kv(ids)
    assert res is not None and res.num_cached_pages == 7 and res.num_cached_tokens == 28
    kv.evict_all()  # an allocation under pressure evicts all it can: not a locked prefix
    assert kv.peek_prefix(ids, "", len(ids) - 1) == 28
    decode.release_prompt_kv(res)
    kv.evict_all()
    assert kv.free_pages == kv.num_pages
    decode.scheduler.check_invariants()
