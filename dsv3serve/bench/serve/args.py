"""The ``dsv3serve bench serve`` flags, the config they build, and the subcommand's entry:
this module imports the benchmark when it runs; nothing in the benchmark imports it."""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import fields
from pathlib import Path
from typing import Any

from dsv3serve.bench.serve.config import BenchServeConfig, BenchServeError, parse_chaos


def _floats(text: str) -> tuple[float, ...]:
    return tuple(float(v) for v in text.split(",") if v.strip())


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(v) for v in text.split(",") if v.strip())


def _path(text: str | None) -> Path | None:
    return Path(text) if text else None


def config_from_args(args: argparse.Namespace) -> BenchServeConfig:
    """The validated config of parsed ``bench serve`` flags (one flag per field)."""
    values = {f.name: getattr(args, f.name) for f in fields(BenchServeConfig)}
    for name in ("dataset_path", "tokenizer", "output_file", "plot"):
        values[name] = _path(values[name])
    values["base_url"] = values["base_url"].rstrip("/")
    values["metrics_urls"] = tuple(values["metrics_urls"])
    return BenchServeConfig(**values)


def _json_object(text: str) -> dict[str, Any]:
    value = json.loads(text)
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


def _add_target_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", required=True, help="server root, e.g. http://127.0.0.1:8000")
    p.add_argument("--endpoint", default="chat", choices=["chat", "completions"])
    p.add_argument("--model", default=None, help="default: the first id of GET /v1/models")
    p.add_argument("--tokenizer", default=None, help="tokenizer dir; default: DeepSeek-V3's")
    p.add_argument("--ignore-eos", action="store_true", help="send ignore_eos (exact lengths)")
    p.add_argument(
        "--extra-request-body", type=_json_object, default={}, help="JSON merged into each body"
    )


def _add_dataset_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--dataset-name",
        default="random",
        choices=["random", "sharegpt", "generated-shared-prefix", "multi-turn"],
        help="generated-shared-prefix: --gsp-num-groups groups of --gsp-prompts-per-group "
        "prompts, each a group's system prompt + its own question (--num-prompts unused); "
        "multi-turn: --mt-num-conversations conversations revisited for --mt-num-turns "
        "rounds, --mt-num-fillers filler prompts after each round",
    )
    p.add_argument("--dataset-path", default=None, help="ShareGPT-format JSON file")
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--random-input-len", type=int, default=1024, help="prompt tokens, BOS included")
    p.add_argument("--random-output-len", type=int, default=128)
    p.add_argument(
        "--random-range-ratio", type=float, default=0.0, help="lengths in [L(1-r), L(1+r)]"
    )
    p.add_argument("--sharegpt-output-len", type=int, default=None, help="override reply lengths")
    p.add_argument("--sharegpt-context-len", type=int, default=2048, help="skip longer pairs")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--gsp-num-groups", type=int, default=4, help="distinct system prompts")
    p.add_argument("--gsp-prompts-per-group", type=int, default=4, help="questions per group")
    p.add_argument(
        "--gsp-system-prompt-len", type=int, default=256, help="system prompt tokens, BOS included"
    )
    p.add_argument("--gsp-question-len", type=int, default=32, help="question tokens")
    p.add_argument("--gsp-output-len", type=int, default=16, help="max_tokens of each request")
    p.add_argument("--mt-num-conversations", type=int, default=4, help="conversations revisited")
    p.add_argument("--mt-num-turns", type=int, default=3, help="rounds over the conversations")
    p.add_argument("--mt-turn-len", type=int, default=128, help="tokens each turn adds")
    p.add_argument("--mt-num-fillers", type=int, default=8, help="filler prompts per round")
    p.add_argument("--mt-filler-len", type=int, default=256, help="tokens of each filler")
    p.add_argument("--mt-output-len", type=int, default=8, help="max_tokens of each request")


def _add_load_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--request-rate", type=float, default=math.inf, help="req/s, Poisson; inf")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--warmup-requests", type=int, default=1)
    sweep = p.add_mutually_exclusive_group()
    sweep.add_argument("--request-rate-sweep", type=_floats, default=(), help="r1,r2,...")
    sweep.add_argument("--concurrency-sweep", type=_ints, default=(), help="c1,c2,...")
    p.add_argument(
        "--plot",
        default=None,
        help="PNG: latency against output throughput (sweep); throughput over time (--chaos)",
    )
    p.add_argument("--output-file", default=None, help="JSON results")
    p.add_argument("--disable-tqdm", action="store_true")


def _add_chaos_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--chaos",
        type=parse_chaos,
        default=(),
        help="kill replicas during the run: DEPLOYMENT@SECONDS,... (e.g. decode-0@10,prefill-0@20)",
    )
    p.add_argument("--chaos-app", default="dsv3serve", help="the Serve app whose replicas die")
    p.add_argument("--ray-address", default="auto", help="the app's Ray cluster (GCS address)")
    p.add_argument(
        "--metrics-url",
        dest="metrics_urls",
        action="append",
        default=[],
        help="a router replica's /metrics (e.g. http://127.0.0.1:8001/metrics; replica k is "
        "on port 8001 + k): counts migrations (--chaos) and the KV pages decode pulled and "
        "reused during each run; repeat it for each router replica",
    )


def _run(args: argparse.Namespace) -> int:
    from dsv3serve.bench.serve.run import run_bench_serve

    try:
        run_bench_serve(config_from_args(args))
    except BenchServeError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    return 0


def add_serve_parser(bench: Any) -> argparse.ArgumentParser:
    """Add ``serve`` to the ``bench`` subparsers (``bench``: argparse's subparsers action)."""
    p = bench.add_parser("serve", help="serving benchmark against an OpenAI-compatible URL")
    _add_target_args(p)
    _add_dataset_args(p)
    _add_load_args(p)
    _add_chaos_args(p)
    p.set_defaults(func=_run)
    return p
