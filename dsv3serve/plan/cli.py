"""``dsv3serve plan``: per-rank memory of a layout, refused (exit 2) if it does not fit; with
``--device cpu`` the KV pool each rank sizes on CPU."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, TypedDict

from dsv3serve.config import ModelConfig
from dsv3serve.json_types import JSONObject
from dsv3serve.kvcache.sizing import DEFAULT_CPU_KV_CACHE_SPACE_GIB
from dsv3serve.parallel.args import add_layout_args, layout_from_args
from dsv3serve.parallel.config import ParallelConfig
from dsv3serve.parallel.shard import RankLayout
from dsv3serve.plan.cpu import CpuSettings, cpu_plan, cpu_plan_json, cpu_plan_table
from dsv3serve.plan.gemm import device_table, gemm_json, gemm_report
from dsv3serve.plan.planner import Plan, PlanError, plan
from dsv3serve.plan.report import plan_json, plan_table


def add_plan_parser(sub: Any) -> None:
    """Add ``plan`` to the ``dsv3serve`` subcommands (SGLang's flag spellings)."""
    p = sub.add_parser("plan", help="per-rank weights, reserves and KV capacity of a layout")
    p.add_argument("--model", default="deepseek-v3", help="checkpoint dir, 'tiny', 'deepseek-v3'")
    add_layout_args(p)
    p.add_argument(
        "--device",
        default="cuda",
        choices=["cuda", "cpu"],
        help="cpu: only the KV pool the engine sizes there, each rank's (no weights)",
    )
    p.add_argument("--gpu-memory-gb", type=float, default=None, help="per GPU, e.g. 141, 80")
    p.add_argument("--mem-fraction-static", type=float, default=0.85)
    p.add_argument("--page-size", type=int, default=None, help="64 on cuda, 16 on cpu (engine's)")
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"], help="cpu")
    p.add_argument(
        "--cpu-kv-cache-space-gib",
        type=float,
        default=DEFAULT_CPU_KV_CACHE_SPACE_GIB,
        help="cpu: the KV cap per host, shared by the group's ranks",
    )
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8_e4m3"])
    p.add_argument(
        "--attention-backend",
        default="flashinfer",
        choices=["torch", "flashinfer", "flashmla"],
        help="fp8 pools: flashmla keeps one scale per layer (576 bytes a token-layer), the "
        "others one per token (580)",
    )
    p.add_argument("--cuda-graph-max-bs", type=int, default=64)
    p.add_argument("--disable-cuda-graph", action="store_true")
    p.add_argument("--chunked-prefill-size", type=int, default=8192)
    p.add_argument(
        "--context-length",
        type=int,
        default=None,
        help="longest request to hold (the engine's max_model_len; cpu default: the model's)",
    )
    p.add_argument(
        "--max-running-requests",
        type=int,
        default=256,
        help="per rank; sizes DeepEP's low-latency buffers under --moe-a2a-backend deepep, "
        "and the KV pool on cpu",
    )
    p.add_argument(
        "--hf-overrides",
        type=_json_object,
        default=None,
        help="config.json fields to replace, as the engine's hf_overrides (JSON), e.g. "
        '\'{"num_hidden_layers": 12, "num_nextn_predict_layers": 0}\'',
    )
    p.add_argument("--enable-hierarchical-cache", action="store_true", help="add a host tier")
    p.add_argument("--hicache-ratio", type=float, default=None, help="host / device KV (2.0)")
    p.add_argument("--hicache-size", type=int, default=None, help="host tier per rank, GB")
    p.add_argument(
        "--gpu-name",
        default=None,
        help="the GPU as torch names it (e.g. 'NVIDIA H200'): which FP8 GEMM runs where by "
        "its measured DeepGEMM table (dsv3serve/kernels/configs/)",
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of the table")
    p.set_defaults(func=run_plan)


def _json_object(text: str) -> JSONObject:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}: {err}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


def model_config(model: str, overrides: JSONObject | None = None) -> ModelConfig:
    """``tiny`` (FP8), a preset name, or a checkpoint directory's config.json, with
    ``overrides`` (the engine's ``hf_overrides``) replacing its fields."""
    from dsv3serve.model.presets import PRESETS
    from dsv3serve.model.tiny import FP8_QUANT_CONFIG, TINY_CONFIG

    if model == "tiny":
        data = {**TINY_CONFIG, "quantization_config": FP8_QUANT_CONFIG}
    elif model in PRESETS:
        data = dict(PRESETS[model])
    else:
        data = json.loads((Path(model) / "config.json").read_text())
    return ModelConfig.from_dict({**data, **(overrides or {})})


def run_plan(args: argparse.Namespace) -> int:
    """Print the plan; on a refusal also the reason on stderr, exit code 2."""
    try:
        parallel = layout_from_args(args)
    except ValueError as err:
        print(f"refused: {err}", file=sys.stderr)
        return 2
    if args.device == "cpu":
        return _run_cpu_plan(args, parallel)
    if args.gpu_memory_gb is None:
        print("refused: --gpu-memory-gb is required with --device cuda", file=sys.stderr)
        return 2
    try:
        result = _plan(args, parallel)
    except PlanError as err:
        if err.plan is not None:
            _print(err.plan, args, fits=False)
        print(f"refused: {err}", file=sys.stderr)
        return 2
    except ValueError as err:  # settings the planner refuses (e.g. both hicache sizes)
        print(f"refused: {err}", file=sys.stderr)
        return 2
    _print(result, args, fits=True)
    return 0


def _run_cpu_plan(args: argparse.Namespace, parallel: ParallelConfig) -> int:
    """Print each rank's CPU KV pool; a budget that holds no page is refused (exit 2)."""
    settings = CpuSettings(
        page_size=16 if args.page_size is None else args.page_size,
        dtype=args.dtype,
        kv_cache_dtype=args.kv_cache_dtype,
        max_running_requests=args.max_running_requests,
        max_model_len=args.context_length,
        cpu_kv_cache_space_gib=args.cpu_kv_cache_space_gib,
    )
    try:
        result = cpu_plan(model_config(args.model, args.hf_overrides), parallel, settings)
    except ValueError as err:
        print(f"refused: {err}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(cpu_plan_json(result, args.model), indent=2))
    else:
        print(cpu_plan_table(result, args.model))
    return 0


def _plan(args: argparse.Namespace, parallel: ParallelConfig) -> Plan:
    return plan(
        model_config(args.model, args.hf_overrides),
        parallel,
        args.gpu_memory_gb,
        args.mem_fraction_static,
        64 if args.page_size is None else args.page_size,
        args.kv_cache_dtype,
        args.cuda_graph_max_bs,
        disable_cuda_graph=args.disable_cuda_graph,
        chunked_prefill_size=args.chunked_prefill_size,
        context_length=args.context_length,
        max_running_requests=args.max_running_requests,
        attention_backend=args.attention_backend,
        **_hicache(args),
    )


class HostTierSize(TypedDict, total=False):
    """The host tier's size, at most one of the two (:class:`PlanExtras`' fields)."""

    hicache_ratio: float | None
    hicache_size: int | None


def _hicache(args: argparse.Namespace) -> HostTierSize:
    """The host tier's size fields; refuses them without ``--enable-hierarchical-cache``."""
    if not args.enable_hierarchical_cache:
        if args.hicache_ratio is not None or args.hicache_size is not None:
            raise ValueError("--hicache-ratio / --hicache-size: add --enable-hierarchical-cache")
        return {}
    if args.hicache_size is not None:
        return {"hicache_size": args.hicache_size}
    return {"hicache_ratio": 2.0 if args.hicache_ratio is None else args.hicache_ratio}


def _print(p: Plan, args: argparse.Namespace, fits: bool) -> None:
    cfg = model_config(args.model, args.hf_overrides)
    layout, max_m = RankLayout(p.parallel, 0), _max_m(args)
    table = device_table(args.gpu_name)
    if args.json:
        data = plan_json(p, args.model, fits)
        data["gemm_backends"] = gemm_json(cfg, layout, max_m, args.gpu_name, table)
        print(json.dumps(data, indent=2))
        return
    print(plan_table(p, args.model))
    print("\n".join(gemm_report(cfg, layout, max_m, args.gpu_name, table)))
    print("fits" if fits else "does not fit")


def _max_m(args: argparse.Namespace) -> int:
    """The most rows one GEMM sees: a prefill chunk (16384 tokens unchunked)."""
    return args.chunked_prefill_size if args.chunked_prefill_size > 0 else 16384
