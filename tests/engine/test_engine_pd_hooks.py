"""Disaggregation hooks: prefill-only export on one engine, import and decode on another."""

from __future__ import annotations

from test_engine import GREEDY, drain, make_engine, prompts, run_alone

from dsv3serve.engine.request import Request


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
