"""Two GPUs: a sharded group's greedy tokens against one GPU's, over NCCL, with CUDA graphs
and the overlap scheduler on (issue 16, item 1).

    python benchmarks/two_gpu_groups.py OUT_DIR [--layouts tp2 tp2-ep2 ...] [--budget-s 360]

Each layout runs the scripted workload of ``tests/support/group_scenario.py`` (chunked
prefill, prefix hits, preemption, an abort) on the tiny checkpoint with DeepSeek-V3's
attention shapes and 16 routed experts, through ``LLM`` (which spawns one process per GPU
and joins them over NCCL). The reference is the one-GPU engine with the same settings
(dtype, backends, graphs, overlap, and MTP where the layout has it). float32 layouts use the
all-to-all dispatcher; DeepEP needs bf16 rows and a hidden size its kernels are built for
(2048, ..., 7168), so its layouts run (as every bf16 run) a checkpoint of hidden size 2048
and compare with a bf16 one-GPU reference on it. flashinfer runs capture CUDA graphs (bf16
only); torch-attention runs are eager (float32 possible). Prints a table and writes
``two_gpu_groups.json``; a layout that raises is recorded with its error.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import logging
import os
import signal
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "support"))
from attention_cases import DEEPSEEK_ATTENTION  # noqa: E402
from group_scenario import DP_KV_TOKENS, LAYOUTS, SCENARIO_ENGINE, run_scenario  # noqa: E402

from dsv3serve.bench.engine.greedy_compare import first_difference, same_input_gap  # noqa: E402
from dsv3serve.engine.config import EngineConfig  # noqa: E402
from dsv3serve.engine.engine import Engine  # noqa: E402
from dsv3serve.engine.llm import LLM  # noqa: E402
from dsv3serve.model.tiny import make_tiny_checkpoint  # noqa: E402

DP2 = LAYOUTS["dp2-ep2"]
DEEPEP = {**DP2, "moe_a2a_backend": "deepep"}
# MTP (the checkpoint's NextN layer drafting 2 tokens a round): a layout's engine-wide
# settings, so its reference is the one-GPU engine with the same speculation (draft, verify
# and extend forwards of the same shapes; greedy MTP is lossless either way)
SPEC = {"speculative_algorithm": "NEXTN", "speculative_num_steps": 2}
REFERENCE_KEYS = tuple(SPEC)
# name -> (dtype, attention backend, layout args), run in this order. flashinfer: CUDA graphs
# (bf16 only); torch: eager, float32 possible (exact comparisons).
RUNS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "tp2-ep2-fp32": ("float32", "torch", LAYOUTS["tp2-ep2"]),
    "dp2-ep2-fp32": ("float32", "torch", DP2),
    "tp2-graphs": ("bfloat16", "flashinfer", LAYOUTS["tp2"]),
    "tp2-ep2-graphs": ("bfloat16", "flashinfer", LAYOUTS["tp2-ep2"]),
    "dp2-ep2-graphs": ("bfloat16", "flashinfer", DP2),
    "dp2-ep2-dp-lm-head-graphs": ("bfloat16", "flashinfer", LAYOUTS["dp2-ep2-dp-lm-head"]),
    "full-width-tp2-ep2-graphs": ("full-width", "flashinfer", LAYOUTS["tp2-ep2"]),
    "full-width-dp2-ep2-graphs": ("full-width", "flashinfer", DP2),
    "dp2-ep2-a2a-bf16": ("bfloat16", "torch", DP2),  # the DeepEP runs' baseline
    "dp2-ep2-deepep-auto": ("bfloat16", "torch", DEEPEP),
    "dp2-ep2-deepep-low-latency": ("bfloat16", "torch", {**DEEPEP, "deepep_mode": "low_latency"}),
    "dp2-ep2-deepep-normal": ("bfloat16", "torch", {**DEEPEP, "deepep_mode": "normal"}),
    "tp2-mtp-graphs": ("bfloat16", "flashinfer", LAYOUTS["tp2"] | SPEC),  # issue 34
    "tp2-mtp-fp32": ("float32", "torch", LAYOUTS["tp2"] | SPEC),  # issue 34, exact
}
# The bench model's layers at DeepSeek-V3's full widths (hidden 7168, 128 heads, q_lora 1536,
# dense MLP 18432, expert MLP 2048, top-8 of 8 groups, FP8 128x128 block weights): one dense
# and one MoE layer, 32 routed experts instead of 256 (the checkpoint is written to disk on
# the GPU machine: ~6 GB instead of ~15 GB), no NextN layer.
FULL_WIDTH: dict[str, Any] = {
    **DEEPSEEK_ATTENTION,
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "q_lora_rank": 1536,
    "num_hidden_layers": 2,
    "first_k_dense_replace": 1,
    "n_routed_experts": 32,
    "num_experts_per_tok": 8,
    "n_group": 8,
    "topk_group": 4,
    "num_nextn_predict_layers": 0,
}
DEVICE_ENGINE: dict[str, Any] = {}  # GPU_ENGINE, or CPU_SMOKE with --device cpu
STALLED = 3  # exit status after a stall (the caller restarts the script on what is left)
GPU_ENGINE = {"device": "cuda", "moe_backend": "triton", "cuda_graph_max_bs": 4}
CPU_SMOKE = {"device": "cpu"}  # --device cpu: the script's plumbing over gloo, not a result


def engine_args(dtype: str, backend: str, layout: dict[str, Any]) -> dict[str, Any]:
    dtype = "bfloat16" if dtype == "full-width" else dtype
    args = {**SCENARIO_ENGINE, **DEVICE_ENGINE, "dtype": dtype, **layout}
    if DEVICE_ENGINE.get("device") == "cuda":
        args["attention_backend"] = backend
    if layout.get("enable_dp_attention"):
        args["num_kv_tokens"] = DP_KV_TOKENS[layout["dp_size"]]
    return args


def checkpoint_for(dtype: str, root: Path) -> Path:
    """The tiny checkpoint a run of ``dtype`` uses (made once per dtype)."""
    path = root / dtype
    if path.exists():
        return path
    t0 = time.monotonic()
    if dtype == "full-width":
        make_tiny_checkpoint(path, fp8=True, overrides=FULL_WIDTH)
    else:
        extra = {} if dtype == "float32" else {"hidden_size": 2048}
        make_tiny_checkpoint(path, fp8=False, overrides=DEEPSEEK_ATTENTION | extra)
    print(f"checkpoint {dtype} written in {time.monotonic() - t0:.1f} s", flush=True)
    return path


def one_gpu(ckpt: Path, dtype: str, backend: str, **extra: Any) -> dict[str, Any]:
    args = engine_args(dtype, backend, {}) | extra
    engine = Engine(EngineConfig(model=str(ckpt), **args))
    top: dict[str, list[dict[int, float]]] = {}
    tokens = run_scenario(engine, top)
    graphs = engine.runner.graphs
    return {"tokens": tokens, "top": top, "graph_steps": 0 if graphs is None else graphs.replays}


def reference(ckpt: Path, dtype: str, backend: str, **same: Any) -> dict[str, Any]:
    """The one-GPU run (with the layout's engine-wide settings ``same``), and its spread: the
    largest same-input log-probability gap between it and the same engine under
    :data:`SPREAD_RUNS`' batchings."""
    ref = one_gpu(ckpt, dtype, backend, **same)
    gaps = [
        compare(one_gpu(ckpt, dtype, backend, **same, **extra), ref)["same_input_logprob_gap"]
        for extra in SPREAD_RUNS
    ]
    return ref | {"spread": max(gaps)}


def run_layout(
    ckpt: Path,
    dtype: str,
    backend: str,
    layout: dict[str, Any],
    on_tokens: Callable[[dict[str, Any]], None] = lambda row: None,
) -> dict[str, Any]:
    """The group's tokens on the scenario; ``on_tokens`` gets the row before the group is
    torn down (a teardown that stalls then still leaves the tokens recorded)."""
    with LLM(str(ckpt), **engine_args(dtype, backend, layout)) as llm:
        top: dict[str, list[dict[int, float]]] = {}
        tokens = run_scenario(llm.engine, top)
        graphs = llm.engine.runner.graphs
        row = {
            "tokens": tokens,
            "top": top,
            "overlap": llm.engine.overlap,
            "graphs": graphs is not None,
            "graph_replays_rank0": 0 if graphs is None else graphs.replays,
            "graph_steps_rank0": 0 if graphs is None else graphs.steps,
        } | spec_graph_runs(llm.engine)
        on_tokens(row)
    return row


def spec_graph_runs(engine: Engine) -> dict[str, Any]:
    """Rank 0's speculative graph runs (verify, draft chain, extend), where MTP is on."""
    spec = engine.spec
    if spec is None:
        return {}
    graphs = spec.graphs
    if graphs is None:
        return {"spec_graphs": False}
    parts = {"verify": graphs.verify, "chain": graphs.chain, "extend": graphs.extend}
    runs = {name: None if part is None else part.runs for name, part in parts.items()}
    return {"spec_graphs": True, "spec_graph_runs_rank0": runs}


# Greedy tokens of bf16 runs may part where the model is nearly tied: the random tiny models
# are flat (the top token's log-probability is about -8, the top 20 within ~0.6 nats), and
# bf16 logits (8 significant bits) move by a few steps when sums are reordered (a TP
# all-reduce, another batch split). Where they part, every position up to and including the
# first difference still had identical inputs on both sides, so the two runs' recorded
# top-20 log-probabilities there are comparable. The one-GPU engine's own spread is measured
# in the same run (:func:`reference`: the same engine with other batching), and a group's
# divergence counts as rounding when its gap stays within SPREAD_FACTOR times that spread;
# a wrong shard or expert moves log-probabilities by whole nats at the first positions.
SPREAD_FACTOR = 2.0
# batchings of the one-GPU engine whose differences from the reference are its own spread
SPREAD_RUNS = (
    {"chunked_prefill_size": 4, "max_num_batched_tokens": 12},
    {"max_running_requests": 1},
)


def compare(got: dict[str, Any], ref: dict[str, Any]) -> dict[str, Any]:
    """A run's tokens (``got["tokens"]``, ``got["top"]``) against the one-GPU reference."""
    want, tokens = ref["tokens"], got["tokens"]
    same = sum(
        1 for rid in want for a, b in zip(tokens.get(rid, []), want[rid], strict=False) if a == b
    )
    diverged, gap = [], 0.0
    for rid, ref_tokens in want.items():
        pos = first_difference(tokens.get(rid, []), ref_tokens)
        n = len(ref_tokens) if pos is None else pos + 1
        gap = max(gap, same_input_gap(got["top"].get(rid, []), ref["top"].get(rid, []), n))
        if tokens.get(rid, []) != ref_tokens:
            diverged.append({"request": rid, "position": pos})
    verdict = "equal"
    if diverged and "spread" in ref:
        within = gap <= SPREAD_FACTOR * ref["spread"]
        verdict = "diverged within the one-GPU spread" if within else "diverged beyond it"
    return {
        "equal": not diverged,
        "verdict": verdict,
        "same_input_logprob_gap": round(gap, 5),
        "one_gpu_spread": ref.get("spread"),
        "matching_tokens": same,
        "reference_tokens": sum(len(v) for v in want.values()),
        "divergences": diverged,
    }


class StallGuard:
    """Watches the layout in progress: past ``stall_s`` it records the layout as stalled,
    has every process of the group dump its threads' stacks (this one directly, the spawned
    ranks on SIGUSR1, which they register with faulthandler), kills the ranks and exits with
    :data:`STALLED`, so the caller can start the script again on the layouts left."""

    def __init__(self, stall_s: float, on_stall: Callable[[str, float], None]) -> None:
        self.stall_s = stall_s
        self._on_stall = on_stall
        self._current: tuple[str, float] | None = None
        threading.Thread(target=self._watch, daemon=True).start()

    def start(self, name: str) -> None:
        self._current = (name, time.monotonic())

    def done(self) -> None:
        self._current = None

    def _watch(self) -> None:
        while True:
            time.sleep(2.0)
            current = self._current
            if current is None or time.monotonic() - current[1] < self.stall_s:
                continue
            name, t0 = current
            print(f"{name}: stalled after {time.monotonic() - t0:.0f} s; stacks:", flush=True)
            children = mp.active_children()
            for proc in children:
                os.kill(proc.pid, signal.SIGUSR1)
            faulthandler.dump_traceback(all_threads=True)  # this process's, signal-free
            time.sleep(3.0)
            self._on_stall(name, time.monotonic() - t0)
            for proc in children:
                proc.kill()
            os._exit(STALLED)


def run_one(
    name: str,
    root: Path,
    refs: dict[str, Any],
    result: dict[str, Any],
    record: Callable[[str, dict[str, Any]], None],
) -> dict:
    """One layout's row: its tokens against the one-GPU reference of its dtype/backend and
    :data:`REFERENCE_KEYS` settings (recorded once before the group's teardown, as
    ``teardown: pending``)."""
    dtype, backend, layout = RUNS[name]
    same = {k: v for k, v in layout.items() if k in REFERENCE_KEYS}
    key = "/".join([dtype, backend, *(f"{k}={v}" for k, v in same.items())])
    meta = {"dtype": dtype, "attention_backend": backend, "layout": layout}

    def early(row: dict[str, Any]) -> None:
        got = {"tokens": row["tokens"], "top": row["top"]}
        rest = {k: v for k, v in row.items() if k not in got}
        record(name, rest | compare(got, refs[key]) | meta | {"teardown": "pending"})

    try:
        ckpt = checkpoint_for(dtype, root)
        if key not in refs:
            refs[key] = reference(ckpt, dtype, backend, **same)
            ref = refs[key]
            result["references"][key] = {k: ref[k] for k in ("graph_steps", "spread")}
        row = run_layout(ckpt, dtype, backend, layout, early)
        row |= compare({"tokens": row.pop("tokens"), "top": row.pop("top")}, refs[key])
        row["teardown"] = "done"
    except Exception as exc:  # recorded: the next layout still runs
        trace = traceback.format_exc()  # the whole chain: the first error comes first
        print(trace, flush=True)
        row = {"error": f"{type(exc).__name__}: {exc}"[:600], "trace": trace[:6000]}
    return row | meta


def new_result(device: str) -> dict[str, Any]:
    return {
        "device": device,
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
        "torch": torch.__version__,
        "engine": DEVICE_ENGINE | {k: v for k, v in SCENARIO_ENGINE.items() if k != "dtype"},
        "checkpoint": "tiny, DeepSeek-V3 attention shapes, 16 routed experts, bf16 weights; "
        "hidden 256 (float32 runs) or 2048 (bfloat16 runs); full-width: FULL_WIDTH (FP8)",
        "references": {},
        "layouts": {},
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("out", type=Path)
    p.add_argument("--layouts", nargs="+", default=list(RUNS), choices=list(RUNS))
    p.add_argument("--budget-s", type=float, default=360.0)
    p.add_argument("--stall-s", type=float, default=240.0, help="a layout past this: stalled")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    DEVICE_ENGINE.update(GPU_ENGINE if args.device == "cuda" else CPU_SMOKE)
    args.out.mkdir(parents=True, exist_ok=True)
    out_json = args.out / "two_gpu_groups.json"
    # a restart after a stall keeps the rows recorded so far and runs the layouts left
    result = json.loads(out_json.read_text()) if out_json.exists() else new_result(args.device)
    root = Path(tempfile.gettempdir()) / "dsv3serve-two-gpu-checkpoints"

    def record(name: str, row: dict[str, Any]) -> None:
        result["layouts"][name] = row
        print(name, {k: v for k, v in row.items() if k not in ("trace", "layout")}, flush=True)
        out_json.write_text(json.dumps(result, indent=1))

    def stalled(name: str, seconds: float) -> None:  # keeps tokens recorded before teardown
        record(name, result["layouts"].get(name, {}) | {"stalled_s": round(seconds)})

    guard = StallGuard(args.stall_s, stalled)
    start = time.monotonic()
    refs: dict[str, Any] = {}
    for name in (n for n in args.layouts if n not in result["layouts"]):
        if time.monotonic() - start > args.budget_s:
            record(name, {"skipped": "time budget spent"})
            continue
        print(f"{name}: starting {RUNS[name][:2]}", flush=True)
        t0 = time.monotonic()
        guard.start(name)
        row = run_one(name, root, refs, result, record)
        guard.done()
        record(name, row | {"seconds": round(time.monotonic() - t0, 1)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
