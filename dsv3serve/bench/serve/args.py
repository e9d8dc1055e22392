"""The ``dsv3serve bench serve`` flags and the validated config they build (stdlib only)."""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Literal

Endpoint = Literal["chat", "completions"]
DatasetName = Literal["random", "sharegpt", "generated-shared-prefix", "multi-turn"]


class BenchServeError(Exception):
    """The benchmark cannot run (server unreachable, warm-up failed, bad dataset)."""


@dataclass(frozen=True)
class ChaosEvent:
    """Kill the replica of Serve deployment ``deployment`` ``at_s`` seconds into the run."""

    deployment: str
    at_s: float


def parse_chaos(spec: str) -> tuple[ChaosEvent, ...]:
    """``DEPLOYMENT@SECONDS[,...]`` (e.g. ``decode-0@10,prefill-0@20``), in time order."""
    events = []
    for part in filter(None, (p.strip() for p in spec.split(","))):
        name, at, seconds = part.rpartition("@")
        try:
            when = float(seconds)
        except ValueError:
            when = -1.0
        if not (at and name and math.isfinite(when) and when >= 0):
            raise argparse.ArgumentTypeError(
                f"--chaos: expected DEPLOYMENT@SECONDS (e.g. decode-0@10), got {part!r}"
            )
        events.append(ChaosEvent(name, when))
    return tuple(sorted(events, key=lambda e: e.at_s))


@dataclass(frozen=True)
class BenchServeConfig:
    """One serving benchmark, or a sweep of them, against an OpenAI-compatible server.

    ``random_range_ratio`` r draws each length uniformly from ``[L * (1 - r), L * (1 + r)]``
    (vLLM's meaning: 0 gives exact lengths). A sweep varies ``request_rate`` or
    ``max_concurrency`` over its points and keeps every other field.
    """

    base_url: str
    endpoint: Endpoint = "chat"
    model: str | None = None
    dataset_name: DatasetName = "random"
    dataset_path: Path | None = None
    num_prompts: int = 100
    random_input_len: int = 1024
    random_output_len: int = 128
    random_range_ratio: float = 0.0
    sharegpt_output_len: int | None = None
    sharegpt_context_len: int = 2048
    gsp_num_groups: int = 4
    gsp_prompts_per_group: int = 4
    gsp_system_prompt_len: int = 256
    gsp_question_len: int = 32
    gsp_output_len: int = 16
    mt_num_conversations: int = 4
    mt_num_turns: int = 3
    mt_turn_len: int = 128
    mt_num_fillers: int = 8
    mt_filler_len: int = 256
    mt_output_len: int = 8
    request_rate: float = math.inf
    max_concurrency: int | None = None
    seed: int = 1
    tokenizer: Path | None = None
    output_file: Path | None = None
    disable_tqdm: bool = False
    ignore_eos: bool = False
    warmup_requests: int = 1
    extra_request_body: dict[str, Any] = field(default_factory=dict)
    plot: Path | None = None
    request_rate_sweep: tuple[float, ...] = ()
    concurrency_sweep: tuple[int, ...] = ()
    chaos: tuple[ChaosEvent, ...] = ()
    chaos_app: str = "dsv3serve"
    ray_address: str = "auto"
    metrics_urls: tuple[str, ...] = ()  # every router replica's /metrics

    def __post_init__(self) -> None:
        problems = [*self._dataset_problems(), *self._load_problems()]
        if problems:
            raise ValueError("bench serve: expected " + "; expected ".join(problems))

    def _dataset_problems(self) -> Iterator[str]:
        if self.endpoint not in ("chat", "completions"):
            yield f"--endpoint chat or completions, got {self.endpoint!r}"
        if self.dataset_name == "sharegpt" and self.dataset_path is None:
            yield "--dataset-path with --dataset-name sharegpt, got none"
        if self.num_prompts < 1:
            yield f"--num-prompts >= 1, got {self.num_prompts}"
        if self.random_input_len < 2:  # BOS plus at least one token of text
            yield f"--random-input-len >= 2, got {self.random_input_len}"
        if self.random_output_len < 1:
            yield f"--random-output-len >= 1, got {self.random_output_len}"
        if not 0 <= self.random_range_ratio < 1:
            yield f"0 <= --random-range-ratio < 1, got {self.random_range_ratio}"
        yield from self._shared_prefix_problems()
        yield from self._multi_turn_problems()

    def _shared_prefix_problems(self) -> Iterator[str]:
        if self.dataset_name != "generated-shared-prefix":
            return
        for name in ("gsp_num_groups", "gsp_prompts_per_group", "gsp_output_len"):
            if getattr(self, name) < 1:
                yield f"--{name.replace('_', '-')} >= 1, got {getattr(self, name)}"
        if self.gsp_system_prompt_len < 2:  # BOS plus at least one token of text
            yield f"--gsp-system-prompt-len >= 2, got {self.gsp_system_prompt_len}"
        if self.gsp_question_len < 1:
            yield f"--gsp-question-len >= 1, got {self.gsp_question_len}"

    def _multi_turn_problems(self) -> Iterator[str]:
        if self.dataset_name != "multi-turn":
            return
        for name in ("mt_num_conversations", "mt_num_turns", "mt_turn_len", "mt_output_len"):
            if getattr(self, name) < 1:
                yield f"--{name.replace('_', '-')} >= 1, got {getattr(self, name)}"
        if self.mt_num_fillers < 0:
            yield f"--mt-num-fillers >= 0, got {self.mt_num_fillers}"
        if self.mt_filler_len < 1:
            yield f"--mt-filler-len >= 1, got {self.mt_filler_len}"
        if self.max_concurrency is None:
            yield "--max-concurrency with --dataset-name multi-turn (its turns are ordered)"

    def _load_problems(self) -> Iterator[str]:
        if self.request_rate <= 0:
            yield f"--request-rate > 0, got {self.request_rate}"
        if self.max_concurrency is not None and self.max_concurrency < 1:
            yield f"--max-concurrency >= 1, got {self.max_concurrency}"
        if self.warmup_requests < 0:
            yield f"--warmup-requests >= 0, got {self.warmup_requests}"
        if any(r <= 0 for r in self.request_rate_sweep):
            yield f"rates > 0 in --request-rate-sweep, got {self.request_rate_sweep}"
        if any(c < 1 for c in self.concurrency_sweep):
            yield f"values >= 1 in --concurrency-sweep, got {self.concurrency_sweep}"
        if self.request_rate_sweep and self.concurrency_sweep:
            yield "one of --request-rate-sweep and --concurrency-sweep, got both"
        if self.chaos and (self.request_rate_sweep or self.concurrency_sweep):
            yield "--chaos with a single run, got a sweep too"

    def points(self) -> list[BenchServeConfig]:
        """One config per benchmark to run: the sweep's points, or this config alone."""
        if self.request_rate_sweep:
            return [replace(self, request_rate=r) for r in self.request_rate_sweep]
        if self.concurrency_sweep:
            return [replace(self, max_concurrency=c) for c in self.concurrency_sweep]
        return [self]


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
