"""``dsv3serve warmup``: build the engine for a config and run one prefill and a few decode
steps, so that every compile and JIT cache the first request needs is filled (Triton,
flashinfer, Inductor, DeepGEMM: under the cache dir, see
:func:`dsv3serve.settings.export_compile_caches`), then report how long each phase took.

The report is also written to ``<cache dir>/warmup/<name>.json``: a record of what the
cache dir was warmed for and how long the run took (a later, warm run shows the gain).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from dsv3serve.engine.config import EngineConfig
from dsv3serve.engine.llm import LLM
from dsv3serve.engine.request import Request
from dsv3serve.json_types import JSONObject, json_str
from dsv3serve.sampling.sampling_params import SamplingParams
from dsv3serve.settings import Settings

WARMUP_ID = "warmup-0"


def warmup_prompt(length: int, vocab: int) -> list[int]:
    """A fixed prompt of ``length`` ordinary ids (no special tokens at the low end)."""
    span = max(1, min(vocab, 128000) - 2)
    return [2 + (7919 * i) % span for i in range(length)]


def _generate(llm: LLM, prompt_len: int, new_tokens: int) -> JSONObject:
    """One greedy request; unix time of its first token, and seconds per phase."""
    engine = llm.engine
    params = SamplingParams(temperature=0, max_new_tokens=new_tokens, ignore_eos=True)
    prompt = warmup_prompt(prompt_len, engine.model_cfg.vocab_size)
    engine.add_request(Request(WARMUP_ID, params, prompt_ids=prompt))
    start = time.perf_counter()
    first_unix: float | None = None
    first_s = tokens = 0.0
    while engine.has_unfinished():
        for out in engine.step():
            if out.token_ids and first_unix is None:
                first_unix, first_s = time.time(), time.perf_counter() - start
            tokens += len(out.token_ids)
    return {
        "first_token_unix": first_unix,
        "prefill_to_first_token_s": first_s,
        "generate_s": time.perf_counter() - start,
        "tokens": int(tokens),
    }


def run_warmup(cfg: EngineConfig, prompt_len: int = 64, new_tokens: int = 4) -> JSONObject:
    """Build the engine, run one request of ``prompt_len`` prompt ids and ``new_tokens``
    decoded; the phases' seconds and the cache dir's variables."""
    settings = Settings.from_env()
    start = time.perf_counter()
    with LLM.from_config(cfg) as llm:
        build_s = time.perf_counter() - start
        result = _generate(llm, prompt_len, new_tokens)
    return {
        "model": cfg.model,
        "device": cfg.device,
        "engine_build_s": build_s,  # weights, KV pool, CUDA-graph capture (logged per size)
        **result,
        "cache_dir": str(settings.cache_dir),
        "compile_caches": settings.compile_cache_env(),
    }


def record_path(cache_dir: Path, model: str) -> Path:
    """Where the report of a warm-up of ``model`` is kept."""
    name = "".join(c if c.isalnum() or c in "-_." else "_" for c in model.strip("/"))
    return cache_dir / "warmup" / f"{name or 'model'}.json"


def write_record(result: JSONObject) -> Path:
    """Write ``result`` to :func:`record_path` under its cache dir; returns the path."""
    cache_dir = json_str(result["cache_dir"], "cache_dir")
    path = record_path(Path(cache_dir), json_str(result["model"], "model"))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1) + "\n")
    return path
