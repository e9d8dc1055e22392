"""Two GPUs: a sharded group's greedy tokens against one GPU's, over NCCL, with CUDA graphs
and the overlap scheduler on (issue 16, item 1).

    python docs/perf/two_gpu_groups.py OUT_DIR [--layouts tp2 tp2-ep2 ...] [--budget-s 360]

Each layout runs the scripted workload of ``tests/support/group_scenario.py`` (chunked
prefill, prefix hits, preemption, an abort) on the tiny checkpoint with DeepSeek-V3's
attention shapes and 16 routed experts, through ``LLM`` (which spawns one process per GPU
and joins them over NCCL). The reference is the one-GPU engine with the same settings
(dtype, backends, graphs, overlap). float32 layouts use the all-to-all dispatcher; DeepEP
needs bf16 rows and a hidden size its kernels are built for (2048, ..., 7168), so its layouts
run (as every bf16 run) a checkpoint of hidden size 2048 and compare with a bf16 one-GPU
reference on it. flashinfer runs capture CUDA graphs (bf16 only); torch-attention runs are
eager (float32 possible). Prints a table and writes ``two_gpu_groups.json``; a layout that
raises is recorded with its error.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "support"))
from attention_cases import DEEPSEEK_ATTENTION  # noqa: E402
from group_scenario import DP_KV_TOKENS, LAYOUTS, SCENARIO_ENGINE, run_scenario  # noqa: E402

from dsv3serve.engine.config import EngineConfig  # noqa: E402
from dsv3serve.engine.engine import Engine  # noqa: E402
from dsv3serve.engine.llm import LLM  # noqa: E402
from dsv3serve.model.tiny import make_tiny_checkpoint  # noqa: E402

DP2 = LAYOUTS["dp2-ep2"]
DEEPEP = {**DP2, "moe_a2a_backend": "deepep"}
# name -> (dtype, attention backend, layout args), run in this order. flashinfer: CUDA graphs
# (bf16 only); torch: eager, float32 possible (exact comparisons).
RUNS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "tp2-ep2-graphs": ("bfloat16", "flashinfer", LAYOUTS["tp2-ep2"]),
    "dp2-ep2-graphs": ("bfloat16", "flashinfer", DP2),
    "tp2-ep2-fp32": ("float32", "torch", LAYOUTS["tp2-ep2"]),
    "dp2-ep2-fp32": ("float32", "torch", DP2),
    "dp2-ep2-dp-lm-head-graphs": ("bfloat16", "flashinfer", LAYOUTS["dp2-ep2-dp-lm-head"]),
    "tp2-graphs": ("bfloat16", "flashinfer", LAYOUTS["tp2"]),
    "dp2-ep2-deepep-auto": ("bfloat16", "torch", DEEPEP),
    "dp2-ep2-deepep-low-latency": ("bfloat16", "torch", {**DEEPEP, "deepep_mode": "low_latency"}),
    "dp2-ep2-deepep-normal": ("bfloat16", "torch", {**DEEPEP, "deepep_mode": "normal"}),
    "dp2-ep2-a2a-bf16": ("bfloat16", "torch", DP2),  # the DeepEP runs' baseline
}
DEVICE_ENGINE: dict[str, Any] = {}  # GPU_ENGINE, or CPU_SMOKE with --device cpu
GPU_ENGINE = {"device": "cuda", "moe_backend": "triton", "cuda_graph_max_bs": 4}
CPU_SMOKE = {"device": "cpu"}  # --device cpu: the script's plumbing over gloo, not a result


def engine_args(dtype: str, backend: str, layout: dict[str, Any]) -> dict[str, Any]:
    args = {**SCENARIO_ENGINE, **DEVICE_ENGINE, "dtype": dtype, **layout}
    if DEVICE_ENGINE.get("device") == "cuda":
        args["attention_backend"] = backend
    if layout.get("enable_dp_attention"):
        args["num_kv_tokens"] = DP_KV_TOKENS[layout["dp_size"]]
    return args


def checkpoint_for(dtype: str, root: Path) -> Path:
    """The tiny checkpoint a run of ``dtype`` uses (made once per dtype)."""
    path = root / dtype
    if not path.exists():
        extra = {} if dtype == "float32" else {"hidden_size": 2048}
        make_tiny_checkpoint(path, fp8=False, overrides=DEEPSEEK_ATTENTION | extra)
    return path


def reference(ckpt: Path, dtype: str, backend: str) -> dict[str, Any]:
    engine = Engine(EngineConfig(model=str(ckpt), **engine_args(dtype, backend, {})))
    tokens = run_scenario(engine)
    graphs = engine.runner.graphs
    return {"tokens": tokens, "graph_steps": 0 if graphs is None else graphs.replays}


def run_layout(ckpt: Path, dtype: str, backend: str, layout: dict[str, Any]) -> dict[str, Any]:
    with LLM(str(ckpt), **engine_args(dtype, backend, layout)) as llm:
        tokens = run_scenario(llm.engine)
        runner = llm.engine.runner
        graphs = runner.graphs
        return {
            "tokens": tokens,
            "overlap": llm.engine.overlap,
            "graphs": graphs is not None,
            "graph_replays_rank0": 0 if graphs is None else graphs.replays,
            "graph_steps_rank0": 0 if graphs is None else graphs.steps,
        }


def compare(got: dict[str, list[int]], want: dict[str, list[int]]) -> dict[str, Any]:
    same = sum(
        1 for rid in want for a, b in zip(got.get(rid, []), want[rid], strict=False) if a == b
    )
    total = sum(len(v) for v in want.values())
    return {"equal": got == want, "matching_tokens": same, "reference_tokens": total}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("out", type=Path)
    p.add_argument("--layouts", nargs="+", default=list(RUNS), choices=list(RUNS))
    p.add_argument("--budget-s", type=float, default=360.0)
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    args = p.parse_args(argv)
    DEVICE_ENGINE.update(GPU_ENGINE if args.device == "cuda" else CPU_SMOKE)
    args.out.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    # a hang (a rank stuck in a collective or a capture) still leaves the leader's stacks
    faulthandler.dump_traceback_later(max(args.budget_s - 10, 10), repeat=True)
    root = Path(tempfile.mkdtemp())
    result: dict[str, Any] = {
        "device": args.device,
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
        "torch": torch.__version__,
        "engine": DEVICE_ENGINE | {k: v for k, v in SCENARIO_ENGINE.items() if k != "dtype"},
        "checkpoint": "tiny, DeepSeek-V3 attention shapes, 16 routed experts, bf16 weights; "
        "hidden 256 (float32 runs) or 2048 (bfloat16 runs)",
        "references": {},
        "layouts": {},
    }
    refs: dict[str, Any] = {}
    for name in args.layouts:
        dtype, backend, layout = RUNS[name]
        key = f"{dtype}/{backend}"
        if time.monotonic() - start > args.budget_s:
            result["layouts"][name] = {"skipped": "time budget spent"}
            continue
        t0 = time.monotonic()
        print(f"{name}: starting ({dtype}, {backend})", flush=True)
        try:
            ckpt = checkpoint_for(dtype, root)
            if key not in refs:
                refs[key] = reference(ckpt, dtype, backend)
                result["references"][key] = {"graph_replays": refs[key]["graph_steps"]}
            row = run_layout(ckpt, dtype, backend, layout)
            row |= compare(row.pop("tokens"), refs[key]["tokens"])
        except Exception as exc:  # recorded: the next layout still runs
            row = {
                "error": f"{type(exc).__name__}: {exc}"[:600],
                "trace": traceback.format_exc()[-1500:],
            }
        seconds = round(time.monotonic() - t0, 1)
        row |= {"dtype": dtype, "attention_backend": backend, "layout": layout, "seconds": seconds}
        result["layouts"][name] = row
        print(name, {k: v for k, v in row.items() if k not in ("trace", "layout")}, flush=True)
        (args.out / "two_gpu_groups.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
