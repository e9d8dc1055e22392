"""``dsv3serve bench model``: prefill, decode and MTP step costs of DeepSeek-V3 at full width.

The model is the repo's own (``ModelRunner`` with the chosen attention and MoE backends)
with one dense layer, as many MoE layers as fit (``--num-moe-layers``) and the NextN
layer, with dummy FP8 weights drawn on the device. The same run's ceilings come first
(``bench kernels``' device copy and GEMM peaks); results are ratios to them.

- prefill: one sequence per input length, tokens/s;
- decode: steps of ``bs`` sequences over a cache pre-filled with random latents, each
  layer's time against its roofline (the bytes it must read / the copy bandwidth);
- MTP: a draft step (NextN layer + head) and a verify step (target over ``k + 1`` tokens per
  sequence) against a decode step, and the speedup per accept length.

Per-layer times are scaled to DeepSeek-V3's 61 layers (3 dense + 58 MoE) for the projected
numbers; the measured ones are kept beside them. Steps run eagerly per part, and whole
through CUDA graphs where the runner captures them (flashinfer on CUDA); graphed steps are
projected to 61 layers with single layers captured alone (``layer_graphs``), and
``--profile-graphs`` lists the kernels of the graphed decode and draft steps. A point
that fails (out of memory, a shape a backend rejects) is recorded with its error and the
run goes on; the JSON is rewritten after every section.
"""

from __future__ import annotations

import argparse
import json
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict
from functools import partial
from pathlib import Path
from typing import Any

import torch

from dsv3serve.bench.model.plan import Plan, make_plan
from dsv3serve.bench.model.points import ModelBench, spec_summary
from dsv3serve.bench.model.profile import profile_graphs
from dsv3serve.bench.model.report import environment, print_report
from dsv3serve.bench.model.roofline import storage_bytes
from dsv3serve.bench.model.setup import (
    activation_reserve_bytes,
    auto_num_moe_layers,
    bench_model_config,
    build_fitting_runner,
    build_runner,
    fill_kv_random,
    footprint,
    run_ceilings,
)
from dsv3serve.engine.model_runner import ModelRunner

TIMING = (
    "per part eager (graphs cannot be split per layer); {clock} around each part, device "
    "idle at each step's start, median of {iters} iterations after {warmup} warm-up "
    "(prefill: {prefill_iters} after 1); decode steps also whole through the runner's "
    "CUDA graphs where it captured them (graph_ms: host padding and planning included)"
)
PROJECTION = (
    "61-layer numbers scale the bench model's mean dense and mean MoE layer to DeepSeek-V3's "
    "3 dense + 58 MoE layers, other parts (embedding, head) as measured; draft steps are not "
    "scaled (the NextN layer is one layer in the full model too)"
)
GRAPH_PROJECTION = (
    "graphed 61-layer: decode_61 = graphed decode + (58 - n_moe) * t_moe(bs, 1) + "
    "(3 - n_dense) * t_dense(bs, 1); verify_61(k) = graphed verify(k) + the same with "
    "t(bs, k + 1); t(bs, w): median replay of one dense / MoE layer captured alone over bs "
    "sequences of w new tokens (pure GPU time); draft chain and extend as measured"
)


def _kv_dtype(kv_cache_dtype: str, compute: torch.dtype) -> torch.dtype:
    return torch.float8_e4m3fn if kv_cache_dtype == "fp8_e4m3" else compute


def choose_num_moe_layers(
    args: argparse.Namespace, device: torch.device, plan: Plan, kv_tokens: int
) -> int:
    """``--num-moe-layers``, else as many as free GPU memory holds (2 on the CPU)."""
    if args.num_moe_layers is not None:
        return args.num_moe_layers
    if device.type != "cuda":
        return 2
    mtp, dtype = not args.no_mtp, torch.bfloat16
    kv_dtype = _kv_dtype(args.kv_cache_dtype, dtype)
    fp = footprint(args.preset, mtp, dtype, kv_tokens, kv_dtype)
    cfg = bench_model_config(args.preset, 1, mtp)
    max_prefill = max(plan.prefill_lens, default=0)
    reserve = activation_reserve_bytes(cfg, max_prefill, args.attention_backend, kv_dtype)
    if args.reserve_gb is not None:
        reserve = int(args.reserve_gb * 1e9)
    return auto_num_moe_layers(torch.cuda.mem_get_info(device)[0], fp, reserve)


def _build(
    args: argparse.Namespace, device: torch.device, kv_tokens: int, num_moe: int
) -> tuple[ModelRunner, float]:
    """The runner with its KV pool filled; seconds it took (weights drawn on the device)."""
    kv = {"page_size": args.page_size, "num_kv_tokens": kv_tokens}
    kv["kv_cache_dtype"] = args.kv_cache_dtype

    def make(n: int) -> ModelRunner:
        cfg = bench_model_config(args.preset, n, not args.no_mtp)
        return build_runner(cfg, str(device), args.attention_backend, args.moe_backend, kv)

    start = time.perf_counter()
    runner = build_fitting_runner(make, num_moe, shrink_on_oom=args.num_moe_layers is None)
    fill_kv_random(runner.pool)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return runner, time.perf_counter() - start


def guarded(point: dict[str, Any], measure: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """``point`` with ``measure()``'s fields, or with ``error`` if it raised; printed as a
    progress line either way."""
    try:
        row = {**point, **measure()}
    except Exception as err:  # recorded in the results; the other points still run
        traceback.print_exc()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        row = {**point, "error": f"{type(err).__name__}: {err}"[:500]}
    brief = {k: v for k, v in row.items() if isinstance(v, (int, float, str))}
    print(json.dumps(brief), flush=True)
    return row


def measure_mtp(bench: ModelBench, decode_rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Draft and verify costs per MTP batch size, reusing decode rows at the MTP context."""
    plan = bench.plan

    def measure(bs: int) -> dict[str, Any]:
        key = (bs, plan.mtp_context)
        found = [r for r in decode_rows if (r["batch_size"], r["context"]) == key]
        decode = found[0] if found and "error" not in found[0] else bench.decode(*key)
        return bench.spec_costs(bs, decode)

    rows = [guarded({"batch_size": bs}, partial(measure, bs)) for bs in plan.mtp_batch_sizes]
    return spec_summary(rows, plan.mtp_context, plan.mtp_steps)


def _config_record(args: argparse.Namespace, runner: ModelRunner, plan: Plan) -> dict[str, Any]:
    cfg = runner.model_cfg
    clock = "CUDA events" if runner.device.type == "cuda" else "host clock"
    timing = TIMING.format(
        clock=clock, iters=plan.iters, warmup=plan.warmup, prefill_iters=plan.prefill_iters
    )
    return {
        "preset": args.preset,
        "hidden_size": cfg.hidden_size,
        "num_attention_heads": cfg.num_attention_heads,
        "n_routed_experts": cfg.n_routed_experts,
        "vocab_size": cfg.vocab_size,
        "num_dense_layers": cfg.first_k_dense_replace,
        "num_moe_layers": cfg.num_hidden_layers - cfg.first_k_dense_replace,
        "num_moe_layers_auto": args.num_moe_layers is None,
        "mtp": cfg.num_nextn_predict_layers > 0,
        "attention_backend": args.attention_backend,
        "moe_backend": args.moe_backend,
        "kv_cache_dtype": args.kv_cache_dtype,
        "page_size": args.page_size,
        "dtype": str(runner.dtype),
        "quick": args.quick,
        "cuda_graph": False,
        "plan": asdict(plan),
        "timing": timing,
        "projection": PROJECTION,
        "projection_graph": GRAPH_PROJECTION,
    }


def _memory_record(runner: ModelRunner, build_s: float) -> dict[str, Any]:
    model = runner.model
    derived = [
        t for m in model.modules() for t in (getattr(m, "w_uk", None), getattr(m, "w_uv", None))
    ]
    tensors = [*model.parameters(), *(t for t in derived if isinstance(t, torch.Tensor))]
    record = {
        "weights_GB": storage_bytes(tensors) / 1e9,
        "kv_cache_GB": runner.pool.nbytes / 1e9,
        "build_s": build_s,
    }
    if runner.device.type == "cuda":
        record["peak_allocated_GB"] = torch.cuda.max_memory_allocated(runner.device) / 1e9
    return record


def _resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def measure_prefill(bench: ModelBench) -> list[dict[str, Any]]:
    """One row per prefill length."""
    return [guarded({"input_len": n}, partial(bench.prefill, n)) for n in bench.plan.prefill_lens]


def measure_decode(bench: ModelBench) -> list[dict[str, Any]]:
    """One row per (context, batch size)."""
    plan = bench.plan
    points = [(b, c) for c in plan.decode_contexts for b in plan.decode_batch_sizes]
    return [
        guarded({"batch_size": b, "context": c}, partial(bench.decode, b, c)) for b, c in points
    ]


def measure_profile(bench: ModelBench) -> dict[str, Any]:
    """Device ops of the graphed decode and draft steps at bs 1 (skipped without CUDA)."""
    if bench.runner.device.type != "cuda":
        return {"skipped": "no CUDA device"}
    plan = bench.plan
    k = max(plan.mtp_steps) if plan.mtp_steps else 3
    return profile_graphs(bench.runner, plan.mtp_context, plan.warmup, plan.iters, k)


def run_bench_model(args: argparse.Namespace) -> dict[str, Any]:
    """Ceilings, build, prefill, decode, MTP; print the tables and write ``args.out``."""
    device, plan = _resolve_device(args.device), make_plan(args)
    result: dict[str, Any] = {"environment": environment(device)}
    result["ceilings"] = run_ceilings(device, args.replays)
    print("ceilings:", json.dumps(result["ceilings"]), flush=True)
    kv_tokens = plan.kv_tokens(args.page_size)
    num_moe = choose_num_moe_layers(args, device, plan, kv_tokens)
    runner, build_s = _build(args, device, kv_tokens, num_moe)
    bench = ModelBench(runner, plan, result["ceilings"]["copy_TBps"])
    result["config"] = _config_record(args, runner, plan)

    def save() -> None:
        result["memory"] = _memory_record(runner, build_s)
        Path(args.out).write_text(json.dumps(result, indent=1))

    save()
    print("built:", json.dumps(result["memory"]), flush=True)
    result["prefill"] = measure_prefill(bench)
    save()
    result["decode"] = measure_decode(bench)
    save()
    result["mtp"] = measure_mtp(bench, result["decode"]) if plan.mtp_batch_sizes else None
    save()
    if args.profile_graphs:
        result["profile_graphs"] = guarded({"profile": "graphs"}, lambda: measure_profile(bench))
        save()
    print_report(result)
    return result
