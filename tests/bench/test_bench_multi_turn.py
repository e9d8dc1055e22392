"""The multi-turn workload of ``dsv3serve bench serve`` and the prefill counters it reads."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from dsv3serve.bench.serve.client import RequestResult
from dsv3serve.bench.serve.config import BenchServeConfig
from dsv3serve.bench.serve.dataset import sample_requests
from dsv3serve.bench.serve.kv_counters import kv_moved, parse_kv_counters
from dsv3serve.bench.serve.multi_turn import ttft_by_kind
from dsv3serve.metrics import EngineState, EngineStateCollector, Identity
from dsv3serve.tokenizer.locate import tokenizer_dir
from dsv3serve.tokenizer.tokenizer import Tokenizer

MT = {
    "dataset_name": "multi-turn",
    "mt_num_conversations": 3,
    "mt_num_turns": 3,
    "mt_turn_len": 12,
    "mt_num_fillers": 2,
    "mt_filler_len": 20,
    "mt_output_len": 4,
    "max_concurrency": 1,
}


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_dir(tokenizer_dir("tiny"))


def test_rounds_revisit_each_conversation_after_fillers(tokenizer: Tokenizer) -> None:
    """3 rounds of (3 conversation turns, 2 fillers); each turn extends its conversation's
    previous turn, fillers are all different."""
    requests = sample_requests(BenchServeConfig("http://x", **MT), tokenizer)
    kinds = [r.kind for r in requests]
    round_kinds = ["conversation"] * 3 + ["filler"] * 2
    assert [k if k == "filler" else "conversation" for k in kinds] == round_kinds * 3
    assert kinds[:3] == ["first_turn"] * 3 and kinds[5:8] == ["revisit"] * 3
    for c in range(3):
        turns = [requests[5 * t + c] for t in range(3)]
        for earlier, later in zip(turns, turns[1:], strict=False):
            assert later.prompt.startswith(earlier.prompt + "\n\n")
            assert later.prompt_len >= earlier.prompt_len + 12
        assert len(tokenizer.encode(turns[0].prompt, add_bos=True)) == turns[0].prompt_len
    fillers = [r.prompt for r in requests if r.kind == "filler"]
    assert len(set(fillers)) == 6 and {r.output_len for r in requests} == {4}


def test_the_same_seed_gives_the_same_requests(tokenizer: Tokenizer) -> None:
    one, two = (sample_requests(BenchServeConfig("http://x", **MT), tokenizer) for _ in range(2))
    assert one == two


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("mt_num_conversations", 0, "--mt-num-conversations >= 1"),
        ("mt_num_turns", 0, "--mt-num-turns >= 1"),
        ("mt_num_fillers", -1, "--mt-num-fillers >= 0"),
        ("mt_filler_len", 0, "--mt-filler-len >= 1"),
        ("max_concurrency", None, "--max-concurrency with --dataset-name multi-turn"),
    ],
)
def test_bad_multi_turn_settings_are_refused(field: str, value: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        BenchServeConfig("http://x", **(MT | {field: value}))


def test_ttft_by_kind_averages_each_part(tokenizer: Tokenizer) -> None:
    config = BenchServeConfig("http://x", **(MT | {"mt_num_turns": 2}))
    requests = sample_requests(config, tokenizer)
    results = [
        RequestResult(r.prompt_len, 4, success=True, ttft_s=0.1 if r.kind == "revisit" else 0.3)
        for r in requests
    ]
    results[-1].success = False
    summary = ttft_by_kind(requests, results)
    assert summary["revisit_requests"] == 3 and summary["revisit_mean_ttft_ms"] == 100
    assert summary["first_turn_mean_ttft_ms"] == pytest.approx(300)
    assert summary["filler_requests"] == 3  # one of the 4 failed


def _exposition(role: str, state: EngineState) -> str:
    registry = CollectorRegistry()
    registry.register(EngineStateCollector(Identity(role, f"{role}-0", "tiny"), lambda: state))
    return generate_latest(registry).decode()


def test_prefill_counters_sum_prefill_and_colocated_replicas() -> None:
    prefill = EngineState(0, 0, 0.0, 100, 60, 0, prefill_tokens=40, host_hits=32)
    decode = EngineState(0, 0, 0.0, 100, 90, 0, prefill_tokens=1000, host_hits=500)
    colocated = EngineState(0, 0, 0.0, 10, 0, 0, prefill_tokens=10, host_loaded_pages=3)
    text = "".join(
        _exposition(role, state)
        for role, state in (("prefill", prefill), ("decode", decode), ("colocated", colocated))
    )
    counters = parse_kv_counters(text)
    assert counters["prefill_tokens_computed"] == 50 and counters["prefix_hit_tokens"] == 60
    assert counters["host_tier_hit_tokens"] == 32 and counters["host_tier_loaded_pages"] == 3
    moved = kv_moved(parse_kv_counters(""), counters)
    assert moved["prefill_tokens_computed"] == 50
