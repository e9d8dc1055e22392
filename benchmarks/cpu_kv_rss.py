"""Peak RSS of every rank of ``LLM("tiny", ...)`` on CPU with no KV size given (issue 45).

Starts the LLM (its follower ranks are child processes), runs a small greedy generate to
the end, and samples ``VmRSS`` / ``VmHWM`` of this process and its children from
``/proc`` every 50 ms from a thread, reading ``VmHWM`` once more before the group stops.
Prints a table, writes JSON.

    PYTHONPATH=. python benchmarks/cpu_kv_rss.py OUT.json \\
        '{"tp_size": 2, "dp_size": 2, "enable_dp_attention": true, "ep_size": 2}'
    PYTHONPATH=. python benchmarks/cpu_kv_rss.py OUT.json '{"dtype": "float32"}'
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time
from pathlib import Path

from dsv3serve.engine.llm import LLM
from dsv3serve.sampling.sampling_params import SamplingParams

PROMPTS = ["The capital of France is", "Hello"]
SAMPLE_S = 0.05


def peak_bytes(pid: int) -> int:
    """The larger of ``VmRSS`` and ``VmHWM`` of ``pid``, in bytes (0 once it is gone)."""
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError:
        return 0
    values = [int(line.split()[1]) * 1024 for line in lines if line[:6] in ("VmRSS:", "VmHWM:")]
    return max(values, default=0)


def children(pid: int) -> list[int]:
    """Direct children of ``pid`` (the group's follower ranks, the resource tracker)."""
    kids: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            kids += [int(k) for k in (task / "children").read_text().split()]
        except OSError:  # a thread that ended meanwhile
            continue
    return kids


class PeakSampler:
    """Keeps the peak RSS of this process and of each child, sampled from a thread."""

    def __init__(self) -> None:
        self.peaks: dict[int, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def sample(self) -> None:
        for pid in [os.getpid(), *children(os.getpid())]:
            self.peaks[pid] = max(self.peaks.get(pid, 0), peak_bytes(pid))

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            time.sleep(SAMPLE_S)

    def __enter__(self) -> PeakSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def measure(engine_args: dict[str, object]) -> dict[str, object]:
    """Run the LLM with ``engine_args`` and return its KV pool and every process's peak."""
    params = SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True)
    start = time.time()
    with PeakSampler() as sampler, LLM("tiny", **engine_args) as llm:
        outs = llm.generate(PROMPTS, params)
        sampler.sample()  # the followers' VmHWM while they are alive
        size = llm.engine.runner.kv_size
    return {
        "engine_args": engine_args,
        "seconds": round(time.time() - start, 1),
        "generated_tokens": [len(o.outputs[0].token_ids) for o in outs],
        "kv_pool": size.describe(),
        "rank0_pid": os.getpid(),
        "peak_rss_bytes": {str(pid): b for pid, b in sorted(sampler.peaks.items())},
    }


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s pid %(process)d %(message)s")
    out, engine_args = Path(sys.argv[1]), json.loads(sys.argv[2]) if len(sys.argv) > 2 else {}
    result = measure(engine_args)
    print(f"engine args {engine_args}; {result['seconds']} s; tokens {result['generated_tokens']}")
    print(f"rank 0 KV pool: {result['kv_pool']}")
    print(f"{'process':<24} {'peak RSS GB':>12}")
    for pid, peak in result["peak_rss_bytes"].items():
        who = "rank 0 (this process)" if int(pid) == os.getpid() else f"child {pid}"
        print(f"{who:<24} {peak / 1e9:>12.2f}")
    out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
