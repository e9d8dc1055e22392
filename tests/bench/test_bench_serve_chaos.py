"""``bench serve --chaos``: the SPEC, and the report's timeline and recovery times.

The report is computed from request results written here (times chosen so each number
can be checked by hand); the kills themselves need a Ray cluster with the app
(``benchmarks/run_chaos_cpu.py`` runs one).
"""

from __future__ import annotations

import argparse

import pytest

from dsv3serve.bench.serve.chaos import (
    Kill,
    chaos_report,
    chunk_times,
    format_chaos,
    output_back_s,
)
from dsv3serve.bench.serve.client import RequestResult
from dsv3serve.bench.serve.config import BenchServeConfig, ChaosEvent, parse_chaos


def test_spec_is_parsed_in_time_order() -> None:
    assert parse_chaos("prefill-0@20, decode-0@10") == (
        ChaosEvent("decode-0", 10.0),
        ChaosEvent("prefill-0", 20.0),
    )


@pytest.mark.parametrize("spec", ["decode-0", "@10", "decode-0@soon", "decode-0@-1", "d@inf"])
def test_bad_spec_names_the_expected_form(spec: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="DEPLOYMENT@SECONDS"):
        parse_chaos(spec)


def test_chaos_is_one_run_not_a_sweep() -> None:
    with pytest.raises(ValueError, match="--chaos with a single run"):
        BenchServeConfig(
            base_url="http://x", chaos=parse_chaos("decode-0@1"), concurrency_sweep=(1, 2)
        )


def streamed(start: float, ttft: float, gaps: list[float], ok: bool = True) -> RequestResult:
    r = RequestResult(prompt_len=8, output_len=len(gaps) + 1, success=ok, start_s=start)
    r.ttft_s, r.itl_s = ttft, gaps
    r.e2e_s = ttft + sum(gaps)
    r.error = "" if ok else "error event in stream: decode replica failed"
    return r


def test_timeline_and_recovery_after_a_kill() -> None:
    # two chunks a second for 0-5 s; the kill at 5.0; nothing until one request sent at 6.0
    # streams again from 8.2 and ends at 10.7; a stream cut by the kill fails at 5.5
    steady = streamed(0.0, 0.5, [0.5] * 8)  # chunks at 0.5 .. 4.5, ends at 4.5
    cut = streamed(1.0, 0.25, [0.5] * 7 + [0.75], ok=False)  # chunks 1.25 .. 4.75, 5.5
    after = streamed(6.0, 2.2, [0.5] * 5)  # chunks at 8.2, 8.7, ..., 10.7
    report = chaos_report([steady, cut, after], 12.0, [Kill("decode-0", 5.0, 5.0, "a")], 3.0)
    line = report["timeline"]
    assert line["chunks"][:6] == [1, 4, 4, 4, 4, 1]  # 5.5 falls in bin 5
    assert line["chunks"][5:] == [1, 0, 0, 2, 2, 2, 0]
    assert line["failed"][5] == 1 and line["completed"][4] == 1 and line["completed"][10] == 1
    (kill,) = report["kills"]
    assert kill["baseline_chunks_per_s"] == pytest.approx(17 / 5)
    assert kill["first_success_s"] == pytest.approx(5.7)
    assert kill["output_back_s"] == pytest.approx(3.0)  # bins 5-7 < 1.7 chunks, 8-10 have 2
    assert (report["failed_requests"], report["migrations"]) == (1, 3.0)
    assert "first success after (s):" in format_chaos(report)


def test_throughput_is_back_after_three_good_bins_or_at_the_next_kill() -> None:
    chunks = [10, 10, 10, 10, 10, 0, 0, 10, 2, 10, 10, 10, 1, 0]
    assert output_back_s(chunks, 5.0, len(chunks), 10.0) == pytest.approx(4.0)  # bins 9-11
    assert output_back_s(chunks, 5.0, 8, 10.0) == pytest.approx(2.0)  # next kill in bin 8
    assert output_back_s(chunks, 0.5, 5, 10.0) == 0.0  # never fell below half
    assert output_back_s(chunks, 12.0, len(chunks), 10.0) is None  # never came back


def test_a_request_failed_before_its_first_chunk_has_no_chunks() -> None:
    refused = RequestResult(prompt_len=8, output_len=4, error="HTTP 503: ...", start_s=2.0)
    assert chunk_times(refused) == []
