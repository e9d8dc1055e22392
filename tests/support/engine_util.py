"""Engine helpers for the tests: the tiny FP8 engine as the engine tests build it, random
prompts, and running requests to completion (formerly in tests/engine/test_engine.py,
which 14 modules imported as a helper library)."""

from __future__ import annotations

import random

from dsv3serve.engine.config import EngineConfig
from dsv3serve.engine.engine import Engine
from dsv3serve.engine.request import Request
from dsv3serve.sampling.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0, max_new_tokens=6, ignore_eos=True)


def make_engine(**kw) -> Engine:
    """Tiny FP8 engine. Activation quantisation is off: per-token e4m3 rounding turns the
    1e-7 float32 differences between batch shapes into different tokens (no serving system
    is batch-invariant with it on), which would hide what these tests check."""
    args = {"model": "tiny", "num_kv_tokens": 2048, "page_size": 4, "fp8_act_quant": False} | kw
    return Engine(EngineConfig(**args))


def prompts(n: int, seed: int = 0, lo: int = 1, hi: int = 40) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2, 128000) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def drain(
    engine: Engine, results: dict[str, list[int]] | None = None, max_steps: int = 10_000
) -> dict[str, list[int]]:
    results = {} if results is None else results
    for _ in range(max_steps):
        if not engine.has_unfinished():
            return results
        for out in engine.step():
            results.setdefault(out.request_id, []).extend(out.token_ids)
    raise AssertionError("engine did not finish")


def run_alone(engine: Engine, ids: list[int], params: SamplingParams = GREEDY) -> list[int]:
    engine.add_request(Request("alone", params, prompt_ids=ids))
    return drain(engine)["alone"]
