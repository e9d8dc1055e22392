"""The offline side of benchmarks/serve_gpu.py: the engine the app's decode replica (or
colocated group) runs, built here from the same deploy file, on this process's GPU."""

from __future__ import annotations

import time
from typing import Any

from dsv3serve.bench.engine.greedy_compare import compare, spread
from dsv3serve.bench.engine.one_batch import measure
from dsv3serve.engine.llm import LLM
from dsv3serve.engine.request import Request
from dsv3serve.sampling.sampling_params import SamplingParams
from dsv3serve.settings import export_compile_caches
from router.config import ServingConfig

GREEDY_TOKENS = 32  # tokens per greedy prompt
TOP = 5  # log-probabilities per position
Tokens = dict[str, list[int]]
Tops = dict[str, list[dict[int, float]]]


def run_greedy(
    engine: Any, prompts: dict[str, list[int]], tokens_out: int, top: int, batched: bool
) -> tuple[Tokens, Tops]:
    """Greedy tokens and top log-probabilities of ``prompts``: all in one batch, or one
    request at a time (``batched=False``: another batching, for the engine's spread)."""
    params = SamplingParams(temperature=0, max_new_tokens=tokens_out, logprobs=top, ignore_eos=True)
    tokens: Tokens = {rid: [] for rid in prompts}
    tops: Tops = {rid: [] for rid in prompts}
    groups = [list(prompts)] if batched else [[rid] for rid in prompts]
    for group in groups:
        for rid in group:
            engine.add_request(Request(f"{rid}.{int(batched)}", params, prompt_ids=prompts[rid]))
        while engine.has_unfinished():
            for out in engine.step():
                rid = out.request_id.rsplit(".", 1)[0]
                tokens[rid] += out.token_ids
                tops[rid] += out.top_logprobs
    return tokens, tops


def as_text(engine: Any, tokens: Tokens, tops: Tops) -> tuple[dict, dict]:
    """Token ids as the strings the HTTP API names them by (its ``_token_text``)."""

    def text(token_id: int) -> str:
        return engine.tokenizer.decode([token_id], skip_special_tokens=False)

    return (
        {rid: [text(t) for t in ids] for rid, ids in tokens.items()},
        {rid: [{text(k): v for k, v in d.items()} for d in ds] for rid, ds in tops.items()},
    )


def offline_reference(
    ctx: dict[str, Any], prompts: dict[str, list[int]], http: dict[str, Any] | None
) -> dict[str, Any]:
    """Greedy reference, its spread, the HTTP comparison and the one-batch decode rates."""
    export_compile_caches(ctx["cache_dir"])  # the compile cache the app filled
    cfg = ServingConfig.parse(ctx["app_args"])
    engine_cfg = cfg.worker_config("decode" if cfg.mode == "pd" else "colocated").engine
    t0 = time.monotonic()
    with LLM.from_config(engine_cfg) as llm:
        engine = llm.engine
        built_s = time.monotonic() - t0
        # as the HTTP side: one at a time first (fresh caches), then the 8 at once
        single = run_greedy(engine, prompts, GREEDY_TOKENS, TOP, batched=False)
        ref = run_greedy(engine, prompts, GREEDY_TOKENS, TOP, batched=True)
        own_spread = spread(ref[0], ref[1], [single])
        ref_text, single_text = as_text(engine, *ref), as_text(engine, *single)
        result: dict[str, Any] = {
            "engine_built_s": round(built_s, 1),
            "engine_config": engine_cfg.model_dump(mode="json"),
            "reference_tokens": ref[0],
            "engine_spread": own_spread,
            "single_vs_batched": compare(single[0], single[1], ref[0], ref[1], own_spread),
        }
        for kind in ("sequential", "whole", "stream"):
            if http and kind in http:
                want = single_text if kind == "sequential" else ref_text
                got = http[kind]
                result[f"http_{kind}"] = compare(
                    got["tokens"], got["top"], want[0], want[1], own_spread
                )
        result["one_batch"] = [
            measure(engine, b, ctx["isl"], ctx["engine_output_len"]) for b in ctx["concurrency"]
        ]
    return result
