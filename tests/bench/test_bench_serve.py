"""``dsv3serve bench serve`` against a real in-process server (uvicorn + the tiny engine).

The benchmark runs through the CLI entry and is checked on what can be known exactly
(token counts, request counts, the relations between its metrics); its timings are
checked against an independent tool, aiperf, run on the same server.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from http_util import ServerThread, free_socket

from dsv3serve.bench.serve.config import BenchServeConfig
from dsv3serve.bench.serve.dataset import sample_requests
from dsv3serve.bench.serve.prompts import exact_prompt
from dsv3serve.cli import main
from dsv3serve.engine.config import EngineConfig
from dsv3serve.engine.engine import Engine
from dsv3serve.tokenizer.locate import tokenizer_dir
from dsv3serve.tokenizer.tokenizer import Tokenizer
from router.api.openai_api import APIConfig, OpenAIServer, build_fastapi_app
from workers.local import LocalEngineBackend

MODEL = "deepseek-v3-tiny"
MAX_MODEL_LEN = 1024
AIPERF = Path(sys.executable).with_name("aiperf")


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    config = EngineConfig(
        model="tiny",
        device="cpu",
        page_size=16,
        num_kv_tokens=8192,
        fp8_act_quant=False,
        max_model_len=MAX_MODEL_LEN,
    )
    engine = Engine(config)
    api = APIConfig(served_model_name=MODEL, max_model_len=MAX_MODEL_LEN)
    server = OpenAIServer(api, engine.tokenizer, LocalEngineBackend(engine))
    with ServerThread(build_fastapi_app(server)) as http:
        yield http.url


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_dir(tokenizer_dir("tiny"))


def bench(url: str, out: Path, flags: str, *paths: str) -> dict[str, Any]:
    """Run ``dsv3serve bench serve`` in this process; its JSON record."""
    argv = ["bench", "serve", "--base-url", url, "--output-file", str(out), "--disable-tqdm"]
    assert main([*argv, "--seed", "0", *flags.split(), *paths]) == 0
    return json.loads(out.read_text())


def check_relations(rec: dict[str, Any]) -> None:
    """What must hold between a run's numbers whatever the timings."""
    ok = [i for i, err in enumerate(rec["errors"]) if not err]
    duration = rec["duration_s"]
    for i in ok:
        ttft, e2e = rec["ttfts_s"][i], rec["e2e_latencies_s"][i]
        assert 0 < ttft <= e2e <= duration
        assert sum(rec["itls_s"][i]) <= e2e - ttft + 1e-9
        assert len(rec["itls_s"][i]) <= rec["output_lens"][i] - 1
    for name in ("ttft", "tpot", "itl", "e2e_latency"):
        assert 0 < rec[f"median_{name}_ms"] <= rec[f"p99_{name}_ms"]
    approx = pytest.approx
    assert rec["request_throughput"] == approx(rec["completed"] / duration)
    assert rec["input_throughput"] == approx(rec["total_input_tokens"] / duration)
    assert rec["output_throughput"] == approx(rec["total_output_tokens"] / duration)
    tokens = rec["total_input_tokens"] + rec["total_output_tokens"]
    assert rec["total_throughput"] == approx(tokens / duration)
    assert rec["concurrency"] == approx(sum(rec["e2e_latencies_s"]) / duration)
    assert rec["mean_e2e_latency_ms"] == approx(1000 * sum(rec["e2e_latencies_s"]) / len(ok))


# ---- the benchmark's own numbers ----------------------------------------------------
def test_exact_prompt_lengths(tokenizer: Tokenizer) -> None:
    rng = random.Random(0)
    for length in (2, 3, 7, 32, 200, 1000):
        text = exact_prompt(tokenizer, rng, length)
        assert len(tokenizer.encode(text, add_bos=True)) == length


def test_random_completions_counts_are_exact(
    url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    flags = "--endpoint completions --num-prompts 16 --max-concurrency 4 --ignore-eos"
    rec = bench(url, tmp_path / "r.json", flags + " --random-input-len 32 --random-output-len 8")
    assert (rec["completed"], rec["failed"], rec["model"]) == (16, 0, MODEL)
    assert rec["errors"] == [""] * 16 and rec["success"] == [True] * 16
    assert rec["total_output_tokens"] == 16 * 8 and rec["output_lens"] == [8] * 16
    # completions prompts count BOS, as the server does: both totals are exact
    assert rec["total_input_tokens"] == rec["total_input_tokens_server"] == 16 * 32
    assert rec["concurrency"] <= 4 + 1e-6
    check_relations(rec)
    table = capsys.readouterr().out
    assert "Successful requests:" in table and "P99 TTFT (ms):" in table


def test_random_chat_prompt_tokens_include_the_template(
    url: str, tmp_path: Path, tokenizer: Tokenizer
) -> None:
    flags = "--num-prompts 4 --random-input-len 20 --random-output-len 3 --random-range-ratio 0.5"
    rec = bench(url, tmp_path / "c.json", flags + " --ignore-eos")
    assert rec["completed"] == 4 and rec["total_output_tokens"] == sum(rec["requested_output_lens"])
    config = BenchServeConfig(
        url, num_prompts=4, random_input_len=20, random_output_len=3, random_range_ratio=0.5, seed=0
    )
    expected = [
        len(tokenizer.encode_chat([{"role": "user", "content": r.prompt}]))
        for r in sample_requests(config, tokenizer)
    ]
    assert rec["server_prompt_tokens"] == expected
    assert all(10 <= n <= 30 for n in rec["input_lens"])
    check_relations(rec)


def sharegpt_file(path: Path) -> list[tuple[str, str]]:
    """Writes six usable pairs and three entries the loader must skip; returns the pairs."""
    pairs = [
        (f"Question {i}: how far is star {i}?", f"About {i + 2} light years.") for i in range(6)
    ]
    entries: list[Any] = [
        {"conversations": [{"from": "human", "value": q}, {"from": "gpt", "value": a}]}
        for q, a in pairs
    ]
    entries += [{"conversations": [{"from": "human", "value": "alone"}]}, {"id": "x"}, []]
    path.write_text(json.dumps(entries))
    return pairs


def test_sharegpt_dataset(url: str, tmp_path: Path, tokenizer: Tokenizer) -> None:
    pairs = sharegpt_file(tmp_path / "sg.json")
    flags = "--dataset-name sharegpt --num-prompts 5 --ignore-eos --endpoint completions"
    flags += " --request-rate 40"  # Poisson arrivals, mean gap 25 ms
    rec = bench(url, tmp_path / "s.json", flags, "--dataset-path", str(tmp_path / "sg.json"))
    assert rec["completed"] == 5
    assert rec["output_lens"] == rec["requested_output_lens"]
    want = {
        (len(tokenizer.encode(q, add_bos=True)), len(tokenizer.encode(a, add_bos=False)))
        for q, a in pairs
    }
    assert set(zip(rec["input_lens"], rec["output_lens"], strict=True)) <= want
    assert rec["server_prompt_tokens"] == rec["input_lens"]
    assert rec["request_rate"] == 40 and rec["start_times_s"] == sorted(rec["start_times_s"])
    assert rec["start_times_s"][-1] > 0
    check_relations(rec)


def test_errors_are_reported_not_raised(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    sharegpt_file(tmp_path / "sg.json")
    with free_socket() as sock:  # bound, never listening: connections are refused
        dead = f"http://127.0.0.1:{sock.getsockname()[1]}"
        assert main(["bench", "serve", "--base-url", dead, "--num-prompts", "1"]) == 1
    assert "expected a model list from GET" in capsys.readouterr().err
    flags = ["--dataset-name", "sharegpt", "--dataset-path", str(tmp_path / "sg.json")]
    assert main(["bench", "serve", "--base-url", dead, *flags, "--num-prompts", "50"]) == 1
    assert "expected 50 usable conversations" in capsys.readouterr().err
    assert main(["bench", "serve", "--base-url", dead, "--random-input-len", "1"]) == 2
    assert "expected --random-input-len >= 2, got 1" in capsys.readouterr().err


def test_concurrency_sweep_plot(url: str, tmp_path: Path) -> None:
    png = tmp_path / "sweep.png"
    flags = "--num-prompts 6 --random-input-len 16 --random-output-len 4 --ignore-eos"
    rec = bench(url, tmp_path / "p.json", flags + " --concurrency-sweep 1,3", "--plot", str(png))
    assert rec["sweep"] == "max_concurrency"
    assert [r["max_concurrency"] for r in rec["runs"]] == [1, 3]
    for run in rec["runs"]:
        assert run["completed"] == 6
        check_relations(run)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


# ---- an independent check of the timings ---------------------------------------------
# aiperf and this benchmark load the same server back to back with the same requests:
# completions, 16 prompts of 33 server-side tokens (aiperf's 32 synthetic tokens plus the
# BOS the server adds; ours count BOS), 8 output tokens with ignore_eos, warm-up 1.
#
# Concurrency 1, not 4: a server step here takes 50-140 ms and batches whatever has
# arrived when it starts, so a millisecond's difference in when the 4 requests arrive
# changes the batches. Our client sends 4 within microseconds and they prefill together;
# aiperf's credits pass through its timing process and arrive 1-2 ms apart, so the first
# prefills alone and the other 3 wait a step (measured at concurrency 4: mean TTFT 61-93
# ms ours vs 97-129 ms aiperf, request throughput 8.1-8.7 vs 5.5-7.0 req/s). That is a
# different load, not a different clock. One at a time, both send the same load.
#
# aiperf paced, not burst: with only --concurrency, aiperf 0.13.0's timing process polls
# for a free slot without sleeping (RequestRateStrategy.execute_phase yields to the event
# loop and retries), taking a whole core of these 2 from the server; measured side by side
# under the same background load, that made its latencies 1.5-2.5x ours. Adding
# --request-rate 1000 --arrival-pattern constant makes it sleep 1 ms between tries, and
# the next request still starts within 1 ms of a slot freeing.
#
# Margin 35%: measured in this setup the two agree within 10% on request throughput and
# mean E2E and within 20% on mean TTFT, which is the shortest number and the one most
# moved by aiperf's half-dozen service processes sharing the CPU. Other sessions' Ray
# tests share these 2 cores and can double every latency for seconds, so a pair that
# disagrees is measured again, up to 3 times; a unit or definition error (s vs ms, TTFT
# taken at the wrong event) would be off by far more than 35% in every pair.
MARGIN = 0.35
AIPERF_ATTEMPTS = 3


def run_ours(url: str, out: Path) -> dict[str, float]:
    """This benchmark in a child process (the server's process keeps its GIL to itself)."""
    flags = (
        "--endpoint completions --num-prompts 16 --random-input-len 33 --random-output-len 8"
        " --ignore-eos --max-concurrency 1 --disable-tqdm"
    )
    argv = [sys.executable, "-m", "dsv3serve.cli", "bench", "serve", "--base-url", url]
    argv += [*flags.split(), "--output-file", str(out)]
    subprocess.run(argv, check=True, capture_output=True, timeout=120)
    rec = json.loads(out.read_text())
    assert rec["completed"] == 16 and rec["total_output_tokens"] == 128
    return {
        "request_throughput": rec["request_throughput"],
        "mean_ttft_ms": rec["mean_ttft_ms"],
        "mean_e2e_ms": rec["mean_e2e_latency_ms"],
        "server_prompt_tokens": rec["total_input_tokens_server"],
    }


def run_aiperf(url: str, out: Path) -> dict[str, float]:
    """aiperf 0.13.0 with the same load: one worker, one record processor, paced 1 ms.

    HF_HUB_OFFLINE must be unset: with it set, aiperf 0.13.0 looks every tokenizer name up
    in the hub cache (``snapshot_download(local_files_only=True)``), which rejects a local
    directory as an invalid repo id. Unset, a path is loaded from disk by transformers.
    """
    flags = (
        "--endpoint-type completions --streaming --isl 32 --isl-stddev 0 --osl 8 --osl-stddev 0"
        " --extra-inputs ignore_eos:true --concurrency 1 --request-count 16"
        " --request-rate 1000 --arrival-pattern constant"
        " --warmup-request-count 1 --random-seed 0 --use-server-token-count --workers-max 1"
        " --record-processors 1 --ui none --no-server-metrics --no-gpu-telemetry"
    )
    argv = [str(AIPERF), "profile", "--model", MODEL, "--url", url, *flags.split()]
    argv += ["--tokenizer", str(tokenizer_dir("tiny")), "--artifact-dir", str(out)]
    offline = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
    env = {k: v for k, v in os.environ.items() if k not in offline}
    # aiperf leaves its mmap files in TMPDIR: a short one of our own (its IPC socket paths
    # must stay short), removed afterwards.
    with tempfile.TemporaryDirectory(prefix="aip") as scratch:
        env["TMPDIR"] = scratch
        subprocess.run(argv, check=True, capture_output=True, timeout=180, env=env, cwd=out.parent)
    rec = json.loads((out / "profile_export_aiperf.json").read_text())
    assert rec["request_count"]["avg"] == 16 and rec["total_usage_completion_tokens"]["avg"] == 128
    return {
        "request_throughput": rec["request_throughput"]["avg"],
        "mean_ttft_ms": rec["time_to_first_token"]["avg"],
        "mean_e2e_ms": rec["request_latency"]["avg"],
        "server_prompt_tokens": rec["total_usage_prompt_tokens"]["avg"],
    }


def disagreements(ours: dict[str, float], theirs: dict[str, float]) -> list[str]:
    out = []
    for key in ("request_throughput", "mean_ttft_ms", "mean_e2e_ms"):
        if abs(ours[key] - theirs[key]) > MARGIN * theirs[key]:
            out.append(f"{key}: ours {ours[key]:.2f}, aiperf {theirs[key]:.2f}")
    return out


@pytest.mark.slow
@pytest.mark.skipif(not AIPERF.exists(), reason="aiperf is not installed in this venv")
def test_timings_agree_with_aiperf(url: str, tmp_path: Path) -> None:
    attempts = []
    for i in range(AIPERF_ATTEMPTS):
        ours = run_ours(url, tmp_path / f"ours{i}.json")
        theirs = run_aiperf(url, tmp_path / f"aiperf{i}")
        assert ours["server_prompt_tokens"] == theirs["server_prompt_tokens"] == 16 * 33
        attempts.append((ours, theirs, disagreements(ours, theirs)))
        if not attempts[-1][2]:
            return
    pytest.fail(f"outside {MARGIN:.0%} in all {AIPERF_ATTEMPTS} pairs: {attempts}")


def test_shared_prefix_workload_runs_every_group(url: str, tmp_path: Path) -> None:
    """``generated-shared-prefix``: groups x prompts requests (``--num-prompts`` unused),
    each asking ``--gsp-output-len`` tokens; no metrics URL, so no KV counters."""
    flags = "--dataset-name generated-shared-prefix --gsp-num-groups 2 --gsp-prompts-per-group 3"
    flags += " --gsp-system-prompt-len 48 --gsp-question-len 8 --gsp-output-len 4"
    rec = bench(url, tmp_path / "g.json", flags + " --ignore-eos --max-concurrency 2")
    assert (rec["completed"], rec["failed"], rec["total_output_tokens"]) == (6, 0, 6 * 4)
    assert (rec["gsp_num_groups"], rec["gsp_prompts_per_group"]) == (2, 3)
    assert "kv_pages_pulled" not in rec
    check_relations(rec)
