"""The ``dsv3serve bench serve`` run's validated config, its error and chaos events (stdlib
only; the flags that build it are in :mod:`dsv3serve.bench.serve.args`)."""

from __future__ import annotations

import argparse
import math
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
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
