"""Property test: random requests, random aborts, a small pool — pages always come back.

Also with speculative decoding, whose decodes hold lookahead pages and roll back
rejected draft slots every round, and with the overlap scheduler, whose sequences may
finish or be aborted while their next step is in flight, and with the hierarchical cache,
whose evicted prefix pages move to a host tier and come back (nothing leaks in either).
"""

from __future__ import annotations

import pytest
from engine_util import make_engine
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dsv3serve.engine.engine import Engine
from dsv3serve.engine.request import Request
from dsv3serve.sampling.sampling_params import SamplingParams

SMALL = {"num_kv_tokens": 160, "chunked_prefill_size": 8, "max_num_batched_tokens": 16}


VARIANTS = ["plain", "speculative", "overlap", "hicache", "hicache-overlap"]


@pytest.fixture(scope="module", params=VARIANTS)
def engine(request: pytest.FixtureRequest) -> Engine:
    extra = {
        "plain": {},
        "speculative": {"speculative_algorithm": "NEXTN", "speculative_num_steps": 2},
        "overlap": {"force_overlap_schedule": True},  # aborts land while a step is in flight
        "hicache": {"enable_hierarchical_cache": True, "hicache_ratio": 0.5},
        "hicache-overlap": {
            "enable_hierarchical_cache": True,
            "hicache_ratio": 0.5,
            "force_overlap_schedule": True,
        },
    }[request.param]
    return make_engine(**SMALL, **extra)


request_st = st.tuples(
    st.lists(st.integers(2, 127999), min_size=1, max_size=30),  # prompt
    st.integers(1, 6),  # max_new_tokens
    st.integers(0, 12),  # abort after this many steps (>= 10: never)
    st.sampled_from([0, 1]),  # shared prefix or not
)


@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(reqs=st.lists(request_st, min_size=1, max_size=12))
def test_random_requests_and_aborts_return_every_page(engine: Engine, reqs) -> None:
    kv = engine.scheduler.kv
    prefix = list(range(1000, 1016))
    aborts: dict[int, list[str]] = {}
    for i, (ids, max_new, abort_at, shared) in enumerate(reqs):
        rid = f"h{i}"
        params = SamplingParams(temperature=0.8, max_new_tokens=max_new, seed=i)
        engine.add_request(Request(rid, params, prompt_ids=(prefix if shared else []) + ids))
        if abort_at < 10:
            aborts.setdefault(abort_at, []).append(rid)
    finished: set[str] = set()
    step = 0
    while engine.has_unfinished():
        for rid in aborts.pop(step, []):
            engine.abort(rid)
        finished |= {o.request_id for o in engine.step() if o.finished}
        engine.scheduler.check_invariants()
        step += 1
        assert step < 2000
    assert finished == {f"h{i}" for i in range(len(reqs))}
    kv.evict_all()
    assert kv.free_pages == kv.num_pages
