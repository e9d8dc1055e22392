"""Issue 27's GPU serving run: the app as a user starts it, timed, checked and loaded.

Stages, run in the order given (``--stages``), each adding its part to ``OUT/serve_gpu.json``
(earlier parts kept, so separate invocations add up):

- ``cold``: start ``dsv3serve serve --config CONFIG`` with an emptied compile cache; record
  the seconds from the command to the first answered request.
- ``warm``: the same with the cache the cold start filled (the app must be stopped first).
- ``greedy``: 8 prompts x 32 tokens, greedy, through HTTP with the official ``openai``
  client (legacy completions, token-id prompts, top-5 logprobs): one at a time first (on
  fresh caches), then the 8 at once, stream and not.
- ``bench``: ``dsv3serve bench serve`` at ISL/OSL ``--isl``/``--osl``, random prompts, one
  run per ``--concurrency`` value (2 x concurrency prompts, at least 4).
- ``chaos``: ``bench serve --chaos decode-0@T`` under load.
- ``stop``: SIGTERM the app, then make sure its Ray cluster is gone and the GPUs are free.
- ``engine``: the offline engine with the decode replica's engine config on this process's
  GPU (run it with ``CUDA_VISIBLE_DEVICES`` naming the decode GPU): the same greedy prompts
  (batched, and one at a time for the engine's own spread), the comparison with the HTTP
  tokens, and ``bench one-batch``'s measurement at the bench's concurrencies.

Usage (repository root; benchmarks/run_serve_gpu.sh sets up the GPU machine):
    python3 benchmarks/serve_gpu.py OUT --config deploy/h200x2-pd.yaml --stages cold,greedy
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_gpu_app import App, wait_gpus_free  # noqa: E402
from serve_gpu_engine import GREEDY_TOKENS, TOP, offline_reference  # noqa: E402

GREEDY_LENS = (17, 33, 64, 100, 129, 200, 256, 400)  # prompt lengths of the 8 prompts
ORDINARY_TOKENS_END = 128000  # DeepSeek-V3's special tokens start here


def greedy_prompts(seed: int = 27) -> dict[str, list[int]]:
    """The greedy check's prompts: token ids of ordinary tokens, fixed by ``seed``."""
    rng = random.Random(seed)
    return {
        f"g{i}": [rng.randrange(2, ORDINARY_TOKENS_END) for _ in range(n)]
        for i, n in enumerate(GREEDY_LENS)
    }


def http_greedy_one(url: str, model: str, ids: list[int], stream: bool) -> tuple[list, list]:
    """One greedy completion through HTTP: its token strings and top-5 log-probabilities."""
    from openai import OpenAI

    client = OpenAI(base_url=f"{url}/v1", api_key="none", timeout=300, max_retries=0)
    body: dict[str, Any] = {
        "model": model,
        "prompt": ids,
        "max_tokens": GREEDY_TOKENS,
        "temperature": 0,
        "logprobs": TOP,
        "extra_body": {"ignore_eos": True},
    }
    tokens: list[str] = []
    tops: list[dict[str, float]] = []
    chunks = (
        client.completions.create(stream=True, **body)
        if stream
        else [client.completions.create(**body)]
    )
    for chunk in chunks:
        for choice in chunk.choices:
            if choice.logprobs is not None:
                tokens += choice.logprobs.tokens or []
                tops += choice.logprobs.top_logprobs or []
    return tokens, tops


def gpu_processes() -> list[str]:
    """Which process holds which GPU (nvidia-smi), with each process's command line: says
    which GPU the prefill and the decode replica got."""
    if shutil.which("nvidia-smi") is None:
        return []
    query = [
        "nvidia-smi",
        "--query-compute-apps=pid,gpu_bus_id,used_memory",
        "--format=csv,noheader",
    ]
    rows = subprocess.run(query, capture_output=True, text=True).stdout.splitlines()
    out = []
    for row in rows:
        pid = row.split(",")[0].strip()
        ps = subprocess.run(["ps", "-o", "args=", "-p", pid], capture_output=True, text=True)
        out.append(f"{row} | {ps.stdout.strip()[:120]}")
    return out


def stage_greedy(ctx: dict[str, Any]) -> dict[str, Any]:
    prompts, out = greedy_prompts(), {"gpu_processes": gpu_processes()}
    # first, on fresh caches: one request at a time, as the engine's one-at-a-time run
    # computes them (same batch sizes and kernels on both sides: expected bit-equal)
    one = {
        rid: http_greedy_one(ctx["url"], ctx["model"], ids, False) for rid, ids in prompts.items()
    }
    out["sequential"] = {
        "tokens": {rid: r[0] for rid, r in one.items()},
        "top": {rid: r[1] for rid, r in one.items()},
    }
    for stream in (False, True):
        with ThreadPoolExecutor(len(prompts)) as pool:
            futures = {
                rid: pool.submit(http_greedy_one, ctx["url"], ctx["model"], ids, stream)
                for rid, ids in prompts.items()
            }
            results = {rid: f.result() for rid, f in futures.items()}
        out["stream" if stream else "whole"] = {
            "tokens": {rid: r[0] for rid, r in results.items()},
            "top": {rid: r[1] for rid, r in results.items()},
        }
    return out


def bench_command(ctx: dict[str, Any], concurrency: int, prompts: int, out: Path) -> list[str]:
    metrics = [
        f"--metrics-url=http://127.0.0.1:{ctx['metrics_port'] + k}/metrics"
        for k in range(ctx["routers"])
    ]
    return [
        sys.executable,
        "-m",
        "dsv3serve.cli",
        "bench",
        "serve",
        "--base-url",
        ctx["url"],
        "--model",
        ctx["model"],
        "--num-prompts",
        str(prompts),
        "--random-input-len",
        str(ctx["isl"]),
        "--random-output-len",
        str(ctx["osl"]),
        "--ignore-eos",
        "--max-concurrency",
        str(concurrency),
        "--seed",
        "1",
        "--disable-tqdm",
        "--output-file",
        str(out),
        *metrics,
    ]


SUMMARY_KEYS = (
    "completed",
    "failed",
    "duration_s",
    "output_throughput",
    "total_input_tokens",
    "median_ttft_ms",
    "p99_ttft_ms",
    "median_itl_ms",
    "p99_itl_ms",
    "median_tpot_ms",
    "kv_pages_pulled",
    "kv_bytes_pulled",
    "kv_pulls",
    "kv_pull_seconds",
    "kv_pages_overlapped",
    "concurrency",
)


def run_bench(
    ctx: dict[str, Any],
    name: str,
    extra: list[str],
    concurrency: int,
    prompts: int,
    timeout_s: float,
) -> dict[str, Any]:
    path = ctx["out"] / "logs" / f"bench_{name}.json"
    cmd = bench_command(ctx, concurrency, prompts, path) + extra
    with (ctx["out"] / "logs" / f"bench_{name}.log").open("w") as log:
        rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=timeout_s).returncode
    if rc != 0 or not path.exists():
        return {"rc": rc}
    record = json.loads(path.read_text())
    record = record[0] if isinstance(record, list) else record
    row = {k: record.get(k) for k in SUMMARY_KEYS} | {"rc": rc, "max_concurrency": concurrency}
    done = max(1, record.get("completed") or 1)
    row["kv_bytes_per_request"] = (record.get("kv_bytes_pulled") or 0) / done
    row["kv_pull_ms_per_request"] = 1e3 * (record.get("kv_pull_seconds") or 0) / done
    row["output_tok_s_per_gpu"] = (record.get("output_throughput") or 0) / ctx["gpus"]
    if "chaos" in record:
        row["chaos"] = record["chaos"]
    return row


def stage_bench(ctx: dict[str, Any]) -> dict[str, Any]:
    rows = {}
    for c in ctx["concurrency"]:
        rows[str(c)] = run_bench(ctx, f"c{c}", [], c, max(4, 2 * c), ctx["bench_timeout_s"])
        print(f"bench c={c}: {json.dumps(rows[str(c)])}", flush=True)
    return rows


def stage_chaos(ctx: dict[str, Any]) -> dict[str, Any]:
    spec = f"decode-0@{ctx['chaos_at_s']}"
    c = ctx["chaos_concurrency"]
    return run_bench(
        ctx, "chaos", ["--chaos", spec], c, ctx["chaos_prompts"], ctx["bench_timeout_s"] * 2
    ) | {"kill": spec}


def stage_engine(ctx: dict[str, Any]) -> dict[str, Any]:
    http = ctx["record"].get("greedy")
    return offline_reference(ctx, greedy_prompts(), http)


def start(ctx: dict[str, Any], cold: bool) -> dict[str, Any]:
    if cold:
        shutil.rmtree(ctx["cache_dir"], ignore_errors=True)
    name = "cold" if cold else "warm"
    ctx["app"] = App(ctx["config"], ctx["cache_dir"], ctx["out"] / "logs" / f"app_{name}.log")
    seconds = ctx["app"].wait_first_answer(ctx["url"], ctx["model"], ctx["start_timeout_s"])
    return {"time_to_first_answer_s": round(seconds, 1), "cache_emptied": cold}


def stage_stop(ctx: dict[str, Any]) -> dict[str, Any]:
    app = ctx.pop("app", None)
    result = app.stop() if app is not None else {"stopped": "no app running"}
    return result | {"gpus_free_after_s": wait_gpus_free()}


STAGES = {
    "cold": lambda ctx: start(ctx, cold=True),
    "warm": lambda ctx: start(ctx, cold=False),
    "greedy": stage_greedy,
    "bench": stage_bench,
    "chaos": stage_chaos,
    "stop": stage_stop,
    "engine": stage_engine,
}


def context(args: argparse.Namespace) -> dict[str, Any]:
    data = yaml.safe_load(Path(args.config).read_text())
    app_args = data["applications"][0]["args"]
    router = app_args.get("router", {})
    http = data.get("http_options", {})
    return {
        "out": args.out,
        "config": args.config,
        "cache_dir": args.cache_dir,
        "url": f"http://127.0.0.1:{http.get('port', 8000)}",
        "model": router.get("served_model_name", "deepseek-v3"),
        "metrics_port": router.get("metrics_port", 8001),
        "routers": router.get("num_replicas", 2),
        "app_args": app_args,
        "gpus": args.gpus,
        "isl": args.isl,
        "osl": args.osl,
        "concurrency": [int(c) for c in args.concurrency.split(",")],
        "chaos_at_s": args.chaos_at_s,
        "chaos_concurrency": args.chaos_concurrency,
        "chaos_prompts": args.chaos_prompts,
        "bench_timeout_s": args.bench_timeout_s,
        "start_timeout_s": args.start_timeout_s,
        "engine_output_len": args.engine_output_len,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("out", type=Path)
    p.add_argument("--config", default="deploy/h200x2-pd.yaml")
    p.add_argument("--stages", default="cold,greedy,bench,stop")
    p.add_argument("--cache-dir", type=Path, default=Path("/tmp/dsv3serve_cache"))
    p.add_argument("--gpus", type=int, default=2, help="GPUs the app uses (per-GPU rates)")
    p.add_argument("--isl", type=int, default=1024)
    p.add_argument("--osl", type=int, default=256)
    p.add_argument("--concurrency", default="1,8,32,128,256")
    p.add_argument("--chaos-at-s", type=float, default=15.0)
    p.add_argument("--chaos-concurrency", type=int, default=32)
    p.add_argument("--chaos-prompts", type=int, default=256)
    p.add_argument("--bench-timeout-s", type=float, default=240.0)
    p.add_argument("--start-timeout-s", type=float, default=480.0)
    p.add_argument("--engine-output-len", type=int, default=32)
    args = p.parse_args()
    (args.out / "logs").mkdir(parents=True, exist_ok=True)
    ctx = context(args)
    path = args.out / "serve_gpu.json"
    ctx["record"] = json.loads(path.read_text()) if path.exists() else {}
    code = 0
    for stage in args.stages.split(","):
        t0 = time.monotonic()
        try:
            part = STAGES[stage](ctx)
        except Exception as exc:  # record it, stop the app, and end the run
            part, code = {"error": f"{type(exc).__name__}: {exc}"}, 1
        part["stage_s"] = round(time.monotonic() - t0, 1)
        ctx["record"][stage] = part
        path.write_text(json.dumps(ctx["record"], indent=1))
        print(f"== {stage} ({part['stage_s']} s): {json.dumps(part)[:600]}", flush=True)
        if code:
            break
    if "app" in ctx:
        print("stop:", ctx.pop("app").stop(), flush=True)
    return code


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, lambda *a: sys.exit(143))
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
