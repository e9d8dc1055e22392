"""Engine behaviour on the tiny FP8 model (CPU, torch reference backends)."""

from __future__ import annotations

import pytest
from engine_util import GREEDY, drain, make_engine, prompts, run_alone

from dsv3serve.engine.engine import Engine, InvalidRequestError
from dsv3serve.engine.request import Request, TokenOutput
from dsv3serve.engine.scheduler.sequence import ContextLengthError
from dsv3serve.sampling.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def solo_engine() -> Engine:
    return make_engine(enable_prefix_caching=False)


@pytest.fixture(scope="module")
def references(solo_engine) -> dict[int, list[int]]:
    """Each of 32 prompts run alone, unchunked, with no prefix cache."""
    return {i: run_alone(solo_engine, p) for i, p in enumerate(prompts(32))}


def test_batched_with_arrivals_mid_run_equals_alone(references) -> None:
    engine = make_engine()
    ps = prompts(32)
    results: dict[str, list[int]] = {}
    for i in range(16):
        engine.add_request(Request(f"r{i}", GREEDY, prompt_ids=ps[i]))
    for _ in range(3):  # a few steps, then the other half arrives
        for out in engine.step():
            results.setdefault(out.request_id, []).extend(out.token_ids)
    # the late half really joins a running batch: nothing has finished yet
    assert results and all(len(v) < GREEDY.max_new_tokens for v in results.values())
    assert engine.scheduler.num_running + engine.scheduler.num_waiting == 16
    for i in range(16, 32):
        engine.add_request(Request(f"r{i}", GREEDY, prompt_ids=ps[i]))
    drain(engine, results)
    assert {int(k[1:]): v for k, v in results.items()} == references
    assert engine.scheduler.kv.used_pages == 0


@pytest.mark.parametrize("chunk", [4, 8, 20])
def test_chunked_prefill_equals_unchunked(references, chunk) -> None:
    engine = make_engine(
        chunked_prefill_size=chunk, max_num_batched_tokens=chunk + 8, enable_prefix_caching=False
    )
    ps = prompts(32)
    for i in range(0, 32, 4):
        engine.add_request(Request(f"r{i}", GREEDY, prompt_ids=ps[i]))
    got = drain(engine)
    assert {int(k[1:]): v for k, v in got.items()} == {i: references[i] for i in range(0, 32, 4)}


def test_prefix_cache_hits_and_keeps_outputs(solo_engine) -> None:
    shared = prompts(1, seed=5, lo=30, hi=30)[0]
    a, b = shared + [11, 12, 13], shared + [21, 22]
    engine = make_engine()
    first = run_alone(engine, a)
    hits_before = engine.scheduler.prefix_hit_tokens
    engine.add_request(Request("b", GREEDY, prompt_ids=b))
    outs: list[TokenOutput] = []
    while engine.has_unfinished():
        outs += engine.step()
    assert engine.scheduler.prefix_hit_tokens - hits_before >= 28  # 7 full pages of 4
    assert outs[-1].cached_tokens >= 28
    assert [t for o in outs for t in o.token_ids] == run_alone(solo_engine, b)
    assert first == run_alone(solo_engine, a)


def test_tenant_salt_isolates_prefix_cache() -> None:
    shared = prompts(1, seed=6, lo=30, hi=30)[0]
    engine = make_engine()
    engine.add_request(Request("a", GREEDY, prompt_ids=shared, salt="tenant-a"))
    drain(engine)
    hits = engine.scheduler.prefix_hit_tokens
    engine.add_request(Request("b", GREEDY, prompt_ids=shared, salt="tenant-b"))
    drain(engine)
    assert engine.scheduler.prefix_hit_tokens == hits
    engine.add_request(Request("c", GREEDY, prompt_ids=shared, salt="tenant-a"))
    drain(engine)
    assert engine.scheduler.prefix_hit_tokens > hits


def test_preemption_under_a_tiny_pool_keeps_outputs(references) -> None:
    engine = make_engine(num_kv_tokens=96, enable_prefix_caching=False)
    ps = prompts(32)
    for i in range(8):
        engine.add_request(Request(f"r{i}", GREEDY, prompt_ids=ps[i]))
    got = drain(engine)
    assert engine.scheduler.num_preemptions > 0
    assert {int(k[1:]): v for k, v in got.items()} == {i: references[i] for i in range(8)}
    assert engine.scheduler.kv.free_pages == engine.scheduler.kv.num_pages


def _free_after_evicting(engine: Engine) -> int:
    engine.scheduler.kv.evict_all()
    return engine.scheduler.kv.free_pages


@pytest.mark.parametrize("state", ["waiting", "mid_prefill", "decoding"])
def test_abort_in_every_state_frees_all_pages(state) -> None:
    engine = make_engine(chunked_prefill_size=4, max_num_batched_tokens=8, max_running_requests=1)
    total = engine.scheduler.kv.num_pages
    engine.add_request(Request("first", GREEDY, prompt_ids=prompts(1, seed=1, lo=30, hi=30)[0]))
    engine.add_request(Request("victim", GREEDY, prompt_ids=prompts(1, seed=2, lo=30, hi=30)[0]))
    target = "first" if state != "waiting" else "victim"
    steps = {"waiting": 1, "mid_prefill": 2, "decoding": 9}[state]
    for _ in range(steps):
        engine.step()
    assert engine.abort(target)
    out = [o for o in engine.step() if o.request_id == target]
    assert out and out[0].finish_reason == "abort"
    drain(engine)
    assert _free_after_evicting(engine) == total
    engine.scheduler.check_invariants()


def test_stop_string_across_token_boundary_is_not_emitted(solo_engine) -> None:
    ids = prompts(1, seed=9)[0]
    full_ids = run_alone(
        solo_engine, ids, SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True)
    )
    text = solo_engine.tokenizer.decode(full_ids)
    pieces = [solo_engine.tokenizer.decode([t]) for t in full_ids]
    cut = len(pieces[0]) + len(pieces[1]) // 2 if len(pieces[1]) > 1 else len(pieces[0])
    stop = text[max(0, cut - 2) : cut + 2]  # spans the boundary of tokens 0/1 (or 1/2)
    engine = make_engine()
    engine.add_request(
        Request(
            "s",
            SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True, stop=[stop]),
            prompt_ids=ids,
        )
    )
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    emitted = "".join(o.text for o in outs)
    assert outs[-1].finish_reason == "stop"
    assert emitted == text[: text.find(stop)]
    assert stop not in emitted


def test_seeded_sampling_is_reproducible_and_n_gives_distinct_samples() -> None:
    engine = make_engine()
    params = SamplingParams(
        temperature=1.0, top_p=0.9, max_new_tokens=8, seed=1234, n=3, ignore_eos=True
    )
    ids = prompts(1, seed=3)[0]

    def run(rid: str, others: int) -> dict[int, list[int]]:
        for j in range(others):
            engine.add_request(
                Request(
                    f"{rid}-noise{j}",
                    SamplingParams(temperature=1.0, max_new_tokens=5),
                    prompt_ids=prompts(1, seed=40 + j)[0],
                )
            )
        engine.add_request(Request(rid, params, prompt_ids=ids))
        got: dict[int, list[int]] = {}
        while engine.has_unfinished():
            for o in engine.step():
                if o.request_id == rid:
                    got.setdefault(o.index, []).extend(o.token_ids)
        return got

    a, b = run("a", 0), run("b", 3)
    assert a == b and len(a) == 3
    assert len({tuple(v) for v in a.values()}) > 1


@pytest.mark.parametrize(
    "bad",
    [
        {"temperature": -1},
        {"top_p": 0},
        {"top_p": 1.5},
        {"n": 0},
        {"max_new_tokens": 0},
        {"top_k": -2},
    ],
)
def test_invalid_sampling_params_fail_before_any_work(bad) -> None:
    with pytest.raises(ValueError, match=next(iter(bad))):
        SamplingParams(**bad)


def test_bad_requests_are_rejected_cleanly() -> None:
    engine = make_engine(max_model_len=64)
    with pytest.raises(ContextLengthError):
        engine.add_request(
            Request("long", SamplingParams(max_new_tokens=40), prompt_ids=list(range(2, 40)))
        )
    with pytest.raises(InvalidRequestError, match="empty"):
        engine.add_request(Request("empty", prompt_ids=[]))
    with pytest.raises(InvalidRequestError, match="token ids"):
        engine.add_request(Request("oov", prompt_ids=[10**7]))
    assert not engine.has_unfinished()
    assert engine.scheduler.kv.free_pages == engine.scheduler.kv.num_pages
    engine.add_request(Request("dup", GREEDY, prompt_ids=[5, 6, 7]))
    with pytest.raises(InvalidRequestError, match="already running"):
        engine.add_request(Request("dup", GREEDY, prompt_ids=[5, 6, 7]))
    drain(engine)
    engine.scheduler.kv.evict_all()
    assert engine.scheduler.kv.free_pages == engine.scheduler.kv.num_pages


def test_min_new_tokens_blocks_eos() -> None:
    engine = make_engine()
    ids = prompts(1, seed=11)[0]
    eos = engine.tokenizer.eos_token_id
    params = SamplingParams(
        temperature=0, max_new_tokens=5, min_new_tokens=5, stop_token_ids=list(range(0, 128815, 2))
    )  # half the vocab stops
    engine.add_request(Request("m", params, prompt_ids=ids))
    got = drain(engine)["m"]
    assert len(got) == 5 and all(t % 2 for t in got[:4]) and eos not in got[:4]
