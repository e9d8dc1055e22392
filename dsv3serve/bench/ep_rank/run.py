"""One EP rank's share of the FULL model on one device, FOR TIMING ONLY (same-rank loopback).

Rank 0 of DP attention + EP over 8 (or 16) ranks -- attention, dense layers, the whole
``lm_head`` (``enable_dp_lm_head``) and 256 / n experts per MoE layer, dummy FP8 weights --
built with the timing-only loopback comm and dispatcher (:mod:`.setup`). Decode steps
over a KV pool of random latents run through the runner's CUDA graphs and are compared with
the bytes the rank must read (:mod:`.bytes`) over the copy bandwidth measured first in
the same run. Dispatch / combine move nothing between ranks here: every row is labelled so.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
from functools import partial
from pathlib import Path
from typing import Any

import torch

from dsv3serve.bench.ep_rank.bytes import local_hits, step_bytes
from dsv3serve.bench.ep_rank.report import config_record, memory_record, print_table
from dsv3serve.bench.ep_rank.setup import (
    EP_LAYOUTS,
    LOOPBACK_LABEL,
    BuildSpec,
    KVChoice,
    KVChoiceName,
    RoutingRecorder,
    build_rank,
    choose_kv,
    ep_model_config,
    ep_parallel,
    planned_rank,
)
from dsv3serve.bench.model.batches import context_batch, context_spans
from dsv3serve.bench.model.report import environment
from dsv3serve.bench.model.run import guarded
from dsv3serve.bench.model.setup import fill_kv_random, run_ceilings
from dsv3serve.bench.model.steps import forward_step
from dsv3serve.bench.model.timing import Marks, time_decode_graph, time_step
from dsv3serve.engine.model_runner import ModelRunner, resolve_dtype
from dsv3serve.parallel.shard import RankLayout


def add_args(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The script's flags (defaults: the H200 run; ``--layout ep16`` for an H100)."""
    p.add_argument("--layout", choices=sorted(EP_LAYOUTS), default="ep8")
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--preset", default="full", help="full: the published DeepSeek-V3 width")
    p.add_argument("--device", default="auto")
    p.add_argument("--attention-backend", default=None, help="flashinfer on CUDA, else torch")
    p.add_argument("--moe-backend", default=None, help="triton on CUDA, else torch")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32, 128])
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--page-size", type=int, default=64)
    p.add_argument("--kv-cache-dtype", choices=["pick", "auto", "fp8_e4m3"], default="pick")
    p.add_argument("--reserve-gb", type=float, default=6.0, help="kept free beside weights+KV")
    p.add_argument("--cpu-room-gb", type=float, default=1.0, help="KV room on the CPU")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--eager-iters", type=int, default=3)
    p.add_argument("--replays", type=int, default=20, help="copy-ceiling replays")
    p.add_argument("--no-cuda-graph", action="store_true")
    p.add_argument("--out", default=None, help="default docs/perf/ep_rank_<gpu>.json")
    return p


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def gpu_tag(device: torch.device) -> str:
    """``h200`` / ``h100`` / a short device name, for the default output file."""
    if device.type != "cuda":
        return "cpu"
    name = torch.cuda.get_device_name(device).lower()
    found = [tag for tag in ("h200", "h100", "b200", "a100") if tag in name]
    return found[0] if found else name.replace(" ", "_")[:24]


def build_spec(args: argparse.Namespace, device: torch.device) -> BuildSpec:
    cuda = device.type == "cuda"
    return BuildSpec(
        device=str(device),
        attention_backend=args.attention_backend or ("flashinfer" if cuda else "torch"),
        moe_backend=args.moe_backend or ("triton" if cuda else "torch"),
        page_size=args.page_size,
        max_batch_size=max(args.batch_sizes),
        cuda_graphs=cuda and not args.no_cuda_graph,
    )


def kv_room_bytes(args: argparse.Namespace, device: torch.device, static_bytes: int) -> int:
    """Device bytes left for the KV pool: free now - the rank's planned weights - reserve."""
    if device.type != "cuda":
        return int(args.cpu_room_gb * 1e9)
    free = torch.cuda.mem_get_info(device)[0]
    return int(free - static_bytes - args.reserve_gb * 1e9)


def build(
    args: argparse.Namespace, layout: RankLayout, spec: BuildSpec, kv: KVChoice
) -> tuple[ModelRunner, RoutingRecorder, KVChoice]:
    """The runner with its pool filled; a bf16 pool that runs out of memory is retried fp8."""
    cfg = ep_model_config(args.preset)
    try:
        runner, recorder = build_rank(cfg, layout, spec, kv)
    except torch.cuda.OutOfMemoryError:
        if kv.kv_cache_dtype == "fp8_e4m3":
            raise
        runner = None
    if runner is None:  # outside the handler: its traceback no longer pins the partial model
        gc.collect()
        torch.cuda.empty_cache()
        print(f"out of memory with a {kv.kv_cache_dtype} KV pool; retrying fp8_e4m3", flush=True)
        return build(args, layout, spec, kv_choice(args, layout, spec, want="fp8_e4m3"))
    fill_kv_random(runner.pool)
    if runner.device.type == "cuda":
        torch.cuda.synchronize(runner.device)
    return runner, recorder, kv


def kv_choice(
    args: argparse.Namespace,
    layout: RankLayout,
    spec: BuildSpec,
    want: KVChoiceName | None = None,
) -> KVChoice:
    """The KV pool for the run, computed before anything is allocated."""
    cfg, device = ep_model_config(args.preset), torch.device(spec.device)
    room = kv_room_bytes(args, device, planned_rank(cfg, layout).static_total)
    compute = torch.bfloat16 if device.type == "cuda" else torch.float32
    return choose_kv(
        cfg,
        args.batch_sizes,
        args.context,
        args.page_size,
        room,
        want or args.kv_cache_dtype,
        compute,
    )


def record_hits(
    runner: ModelRunner, recorder: RoutingRecorder, batch_size: int, context: int
) -> list[int]:
    """One eager step of the batch with the recorder on: the local experts each MoE layer's
    routing hits (the graphed steps replay the same tokens, hence the same routing)."""
    batch = _batch(runner, batch_size, context)
    recorder.calls, recorder.recording = [], True
    try:
        runner.model(batch, runner.attn)
    finally:
        recorder.recording = False
    layout = runner.parts.layout
    if layout is None:
        raise RuntimeError("expected the rank's expert-parallel layout, found none")
    experts = layout.expert_range(runner.model_cfg.n_routed_experts)
    return local_hits(recorder.calls, experts)


def _batch(runner: ModelRunner, batch_size: int, context: int) -> Any:
    page, vocab = runner.cfg.page_size, runner.model_cfg.vocab_size
    return context_batch(batch_size, context, 1, page, vocab, runner.device)


def time_eager(runner: ModelRunner, batch_size: int, context: int, iters: int) -> float:
    """Median ms of the eager decode step (model + logits), 1 warm-up."""
    batch = _batch(runner, batch_size, context)
    step = forward_step(runner.model, runner.attn, batch, batch.logits_indices)
    return time_step(step, Marks(runner.device), 1, iters).ms


def measure_point(
    runner: ModelRunner,
    recorder: RoutingRecorder,
    args: argparse.Namespace,
    point: tuple[int, int, float],
) -> dict[str, Any]:
    """One (batch size, context, copy TB/s) point: graphed and eager ms against the bytes."""
    bs, context, copy_TBps = point
    hits = record_hits(runner, recorder, bs, context)
    spans = context_spans(bs, context, 1, runner.cfg.page_size, runner.model_cfg.vocab_size)
    graph_ms = time_decode_graph(runner, spans, args.warmup, args.iters)
    eager_ms = time_eager(runner, bs, context, args.eager_iters)
    nbytes = step_bytes(runner, bs, context, hits)
    roof_ms = nbytes.total / (copy_TBps * 1e9)
    ms = graph_ms if graph_ms is not None else eager_ms
    return {
        "timed": "cuda_graph" if graph_ms is not None else "eager (no graph for this step)",
        "ms": ms,
        "graph_ms": graph_ms,
        "eager_ms": eager_ms,
        "tokens_per_s": bs / ms * 1e3,
        "bytes": nbytes.parts,
        "total_bytes": nbytes.total,
        "roofline_ms": roof_ms,
        "ratio": ms / roof_ms,
        "local_experts_hit": _spread(hits),
    }


def _spread(values: list[int]) -> dict[str, float]:
    return {"mean": statistics.fmean(values), "min": min(values), "max": max(values)}


def run_ep_rank(args: argparse.Namespace) -> dict[str, Any]:
    """Ceilings, KV choice, build, then one guarded row per batch size; JSON to ``out``."""
    device = resolve_device(args.device)
    out = Path(args.out or f"docs/perf/ep_rank_{gpu_tag(device)}.json")
    layout = RankLayout(ep_parallel(EP_LAYOUTS[args.layout]), args.rank)
    result: dict[str, Any] = {"label": LOOPBACK_LABEL, "environment": environment(device)}
    result["ceilings"] = run_ceilings(device, args.replays)
    print("ceilings:", json.dumps(result["ceilings"]), flush=True)
    spec = build_spec(args, device)
    runner, recorder, kv = build(args, layout, spec, kv_choice(args, layout, spec))
    result["config"] = config_record(args, runner, kv, resolve_dtype(runner.cfg))
    result["memory"] = memory_record(runner, planned_rank(runner.model_cfg, layout))
    print("memory:", json.dumps(result["memory"]), flush=True)
    result["decode"] = []
    for bs in args.batch_sizes:
        point = {"batch_size": bs, "context": kv.contexts[bs], "label": LOOPBACK_LABEL}
        measure = (bs, kv.contexts[bs], result["ceilings"]["copy_TBps"])
        result["decode"].append(
            guarded(point, partial(measure_point, runner, recorder, args, measure))
        )
        out.write_text(json.dumps(result, indent=1))
    if device.type == "cuda":
        result["memory"]["peak_allocated_GB"] = torch.cuda.max_memory_allocated(device) / 1e9
    out.write_text(json.dumps(result, indent=1))
    print_table(result)
    print(f"wrote {out}")
    return result
