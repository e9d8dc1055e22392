"""One scripted workload for comparing a sharded group with the single-rank engine.

A batch with chunked prefill (prompts longer than the chunk), prefix hits (prompts sharing
a page-aligned prefix, some arriving after it is cached), preemption (a KV pool too small
for every sequence at once) and an abort mid-generation. Greedy (temperature 0), so the
tokens depend only on the model's numbers, not on batching.
"""

from __future__ import annotations

from typing import Any

from dsv3serve.engine.request import Request
from dsv3serve.sampling.sampling_params import SamplingParams

SCENARIO_ENGINE: dict[str, Any] = {
    "dtype": "float32",
    "page_size": 4,
    "num_kv_tokens": 56,  # two long sequences do not fit at once: preemption
    "chunked_prefill_size": 8,
    "max_num_batched_tokens": 24,
    "max_running_requests": 4,
}
PREFIX = [100 + i for i in range(12)]
PROMPTS = {
    "aborted": [900, 901, 902, 903, 904],
    "long-a": PREFIX + [7, 8, 9, 10, 11, 12, 13, 14, 15, 16],
    "long-b": [300 + i for i in range(21)],
    "hit": PREFIX + [40, 41, 42],
    "short": [5, 6, 7],
}
LATE = ("hit",)
# the group layouts the scenario runs under (tests/parallel)
LAYOUTS: dict[str, dict[str, Any]] = {
    "tp2": {"tp_size": 2},
    "tp2-ep2": {"tp_size": 2, "ep_size": 2},
    "dp2-ep2": {"tp_size": 2, "dp_size": 2, "enable_dp_attention": True, "ep_size": 2},
    "dp2-ep2-dp-lm-head": {
        "tp_size": 2,
        "dp_size": 2,
        "enable_dp_attention": True,
        "ep_size": 2,
        "enable_dp_lm_head": True,
    },
    "tp4-ep4": {"tp_size": 4, "ep_size": 4},
    "dp4-ep4": {"tp_size": 4, "dp_size": 4, "enable_dp_attention": True, "ep_size": 4},
}
# DP attention gives each rank its own pool of num_kv_tokens: smaller ones (by dp_size) so
# the workload still preempts on a rank that holds two sequences.
DP_KV_TOKENS = {2: 40, 4: 32}  # added after the first steps, when PREFIX is cached
ABORT_AT_STEP = 5
TOP_LOGPROBS = 20
MAX_NEW = 10


def _request(rid: str, logprobs: int | None) -> Request:
    params = SamplingParams(temperature=0, max_new_tokens=MAX_NEW, logprobs=logprobs)
    return Request(rid, params, prompt_ids=PROMPTS[rid])


def run_scenario(
    engine: Any, top: dict[str, list[dict[int, float]]] | None = None
) -> dict[str, list[int]]:
    """Drive ``engine`` through the workload; the output token ids of every request. With
    ``top``, each request also asks for its :data:`TOP_LOGPROBS` most likely tokens per
    position, which land in ``top[request id]`` (to tell a near-tie from a wrong number
    where two runs differ)."""
    tokens: dict[str, list[int]] = {rid: [] for rid in PROMPTS}
    logprobs = None if top is None else TOP_LOGPROBS
    for rid in PROMPTS:
        if rid not in LATE:
            engine.add_request(_request(rid, logprobs))
    step = 0
    while engine.has_unfinished() or step <= ABORT_AT_STEP + 1:
        if step == ABORT_AT_STEP:
            engine.abort("aborted")
        if step == ABORT_AT_STEP + 1:
            for rid in LATE:
                engine.add_request(_request(rid, logprobs))
        for out in engine.step():
            tokens[out.request_id] += out.token_ids
            if top is not None:
                top.setdefault(out.request_id, []).extend(out.top_logprobs)
        step += 1
        assert step < 500, "the scenario did not finish"
    return tokens


def assert_no_leaks(engine: Any) -> None:
    """Every page came back (cached prefix pages are reclaimable, not held)."""
    engine.scheduler.check_invariants()
    assert engine.scheduler.kv.used_pages == 0
    assert engine.scheduler.num_running == engine.scheduler.num_waiting == 0
