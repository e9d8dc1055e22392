"""The shared-prefix workload of ``dsv3serve bench serve`` and the KV counters it reads."""

from __future__ import annotations

import pytest
from prometheus_client import generate_latest

from dsv3serve.bench.serve.config import BenchServeConfig
from dsv3serve.bench.serve.dataset import sample_requests
from dsv3serve.bench.serve.kv_counters import PREFILL_COUNTERS, kv_moved, parse_kv_counters
from dsv3serve.metrics import EngineState, Identity
from dsv3serve.tokenizer.locate import tokenizer_dir
from dsv3serve.tokenizer.tokenizer import Tokenizer
from kv_transfer.handle import TransferStats
from workers.worker_metrics import WorkerMetrics

GSP = {
    "dataset_name": "generated-shared-prefix",
    "gsp_num_groups": 3,
    "gsp_prompts_per_group": 4,
    "gsp_system_prompt_len": 40,
    "gsp_question_len": 8,
    "gsp_output_len": 5,
}


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_dir(tokenizer_dir("tiny"))


def test_groups_share_their_system_prompt_and_nothing_else(tokenizer: Tokenizer) -> None:
    """Grouped by their first 38 tokens (the system prompt's, short of a seam that may
    merge), the 12 prompts make 3 groups of 4, all different after that."""
    requests = sample_requests(BenchServeConfig("http://x", seed=3, **GSP), tokenizer)
    assert len(requests) == 12 and {r.output_len for r in requests} == {5}
    groups: dict[tuple[int, ...], list[str]] = {}
    for r in requests:
        ids = tokenizer.encode(r.prompt, add_bos=True)
        assert len(ids) == r.prompt_len and abs(r.prompt_len - (40 + 8)) <= 4
        groups.setdefault(tuple(ids[:38]), []).append(r.prompt)
    assert sorted(map(len, groups.values())) == [4, 4, 4]
    assert len({r.prompt for r in requests}) == 12
    order = [next(i for i, g in enumerate(groups.values()) if r.prompt in g) for r in requests]
    assert order != sorted(order), "the requests were not shuffled"


def test_the_same_seed_gives_the_same_requests(tokenizer: Tokenizer) -> None:
    one, two = (sample_requests(BenchServeConfig("http://x", **GSP), tokenizer) for _ in range(2))
    assert one == two


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("gsp_num_groups", 0, "--gsp-num-groups >= 1"),
        ("gsp_prompts_per_group", 0, "--gsp-prompts-per-group >= 1"),
        ("gsp_system_prompt_len", 1, "--gsp-system-prompt-len >= 2"),
        ("gsp_question_len", 0, "--gsp-question-len >= 1"),
        ("gsp_output_len", 0, "--gsp-output-len >= 1"),
    ],
)
def test_bad_shared_prefix_settings_are_refused(field: str, value: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        BenchServeConfig("http://x", **(GSP | {field: value}))


def exposition(role: str, pulled: int, reused: int) -> str:
    """A real worker's metrics text after one transfer of ``pulled`` pages."""
    idle = EngineState(0, 0, 0.0, 0, 0, 0)
    metrics = WorkerMetrics(Identity(role, f"{role}-0", "tiny"), [lambda: idle])
    metrics.transferred(TransferStats(request_id="r", nbytes=1000, seconds=0.1), pulled, reused)
    return generate_latest(metrics.m.registry).decode()


def test_kv_counters_sum_the_decode_replicas_only() -> None:
    text = exposition("decode", 3, 2) + exposition("prefill", 7, 7)
    assert parse_kv_counters(text) == {
        "kv_pages_pulled": 3,
        "kv_pages_reused": 2,
        "kv_pages_overlapped": 0,
        "kv_bytes_pulled": 1000,
        "kv_pulls": 1,
        "kv_pull_seconds": 0.1,
    } | dict.fromkeys(PREFILL_COUNTERS, 0)
    before = parse_kv_counters("")
    assert kv_moved(before, parse_kv_counters(text))["kv_pages_pulled"] == 3
    assert kv_moved(None, before) == {}
