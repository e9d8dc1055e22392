"""``dsv3serve serve``, ``generate``, ``plan`` and ``bench {one-batch,serve,kernels,model}``."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from dsv3serve.bench.engine.group import add_group_arguments
from dsv3serve.bench.kernels.run import add_kernels_parser
from dsv3serve.bench.model.args import add_model_parser
from dsv3serve.bench.serve.args import add_serve_parser
from dsv3serve.engine.config import EngineConfig
from dsv3serve.kvcache.sizing import DEFAULT_CPU_KV_CACHE_SPACE_GIB
from dsv3serve.parallel.args import add_layout_args
from dsv3serve.plan.cli import add_plan_parser
from dsv3serve.settings import export_compile_caches
from router.launch_start import APP_START_S, PROXY_START_S

if TYPE_CHECKING:
    from dsv3serve.engine.engine import Engine


def _engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="tiny", help="checkpoint dir, 'tiny', or 'deepseek-v3'")
    p.add_argument("--load-format", default="auto", choices=["auto", "safetensors", "dummy"])
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--num-kv-tokens", type=int, default=None)
    p.add_argument("--mem-fraction-static", type=float, default=0.85, help="GPU KV budget")
    p.add_argument(
        "--cpu-kv-cache-space-gib",
        type=float,
        default=DEFAULT_CPU_KV_CACHE_SPACE_GIB,
        help="CPU KV pool cap per host, shared by the group's ranks there (without "
        "--num-kv-tokens the pool holds max-running-requests x the context, up to this)",
    )
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8_e4m3"])
    p.add_argument("--chunked-prefill-size", type=int, default=8192)
    p.add_argument("--max-running-requests", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=16384)
    p.add_argument("--disable-prefix-caching", action="store_true")
    p.add_argument(
        "--enable-hierarchical-cache",
        action="store_true",
        help="keep the prefix cache's evicted pages in a host-memory tier and load them back",
    )
    p.add_argument(
        "--hicache-ratio", type=float, default=None, help="host tier / device KV pool (2.0)"
    )
    p.add_argument("--hicache-size", type=int, default=None, help="host tier in GB (1e9 B)")
    p.add_argument(
        "--moe-backend",
        default="torch",
        choices=["torch", "triton"],
        help="routed experts: torch reference, or fused Triton kernels (CUDA)",
    )
    p.add_argument(
        "--shared-experts-fusion",
        default="auto",
        choices=["auto", "on", "off"],
        help="run the shared expert as expert E inside the fused MoE (off = SGLang's "
        "--disable-shared-experts-fusion; auto: where measured faster on this GPU)",
    )
    p.add_argument(
        "--attention-backend",
        default="torch",
        choices=["torch", "flashinfer", "flashmla"],
        help="flashmla: FlashMLA decode and verify (needs --page-size 64 and sgl-flash-mla)",
    )
    p.add_argument(
        "--disable-cuda-graph",
        action="store_true",
        help="run decode steps eagerly (graphs need CUDA and --attention-backend flashinfer "
        "or flashmla)",
    )
    p.add_argument("--cuda-graph-max-bs", type=int, default=64, help="largest captured batch")
    p.add_argument(
        "--disable-overlap-schedule",
        action="store_true",
        help="run schedule, forward and output processing back to back (overlap: CUDA only)",
    )
    p.add_argument(
        "--enable-torch-compile",
        action="store_true",
        help="torch.compile the CUDA-graph decode forward (CUDA graphs on)",
    )
    p.add_argument(
        "--torch-compile-max-bs", type=int, default=32, help="largest compiled decode batch"
    )
    _speculative_args(p)
    _cache_arg(p)
    add_layout_args(p)
    p.add_argument(
        "--disable-moe-dispatch-metrics",
        action="store_true",
        help="no dsv3serve:moe_dispatch_* metrics: EP dispatch / combine record no CUDA events",
    )
    p.add_argument(
        "--disable-any-whitespace",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="structured JSON output (json_schema, json_object, tool-call arguments) without "
        "whitespace between elements (default); --no-disable-any-whitespace allows any",
    )
    p.add_argument(
        "--hf-overrides",
        type=json.loads,
        default=None,
        help="JSON, e.g. '{\"num_hidden_layers\": 4}'",
    )


def _cache_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--cache-dir",
        type=Path,
        default=None,
        help="where checkpoints made here, tuned tables and the compile caches (Triton, "
        "flashinfer, Inductor, DeepGEMM) persist (default: $DSV3SERVE_CACHE, else "
        "~/.cache/dsv3serve)",
    )


def _speculative_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--speculative-algorithm",
        choices=["NEXTN", "EAGLE"],
        default=None,
        help="draft with the checkpoint's NextN (MTP) layer (EAGLE: same thing)",
    )
    p.add_argument("--speculative-num-steps", type=int, default=None, help="draft steps (3)")
    p.add_argument("--speculative-eagle-topk", type=int, default=None, help="only 1")
    p.add_argument("--speculative-num-draft-tokens", type=int, default=None, help="steps + 1")
    p.add_argument(
        "--speculative-draft-model-quantization", choices=["fp8", "unquant"], default=None
    )


def _cmd_generate(args: argparse.Namespace) -> int:
    from dsv3serve.engine.llm import LLM

    cfg = EngineConfig.from_args(args, num_kv_tokens=args.num_kv_tokens or 8192)
    with LLM.from_config(cfg) as llm:  # --tp-size N: starts the other ranks here
        return _generate(llm.engine, args)


def _generate(engine: Engine, args: argparse.Namespace) -> int:
    from dsv3serve.engine.request import Request
    from dsv3serve.sampling.sampling_params import SamplingParams

    params = SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        max_new_tokens=args.max_new_tokens,
        seed=args.seed,
    )
    for i, prompt in enumerate(args.prompt):
        text = (
            engine.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
            if args.chat
            else prompt
        )
        ids = engine.tokenizer.encode(text, add_bos=True)
        engine.add_request(Request(f"cli-{i}", params, prompt_ids=ids))
    texts: dict[str, str] = {}
    while engine.has_unfinished():
        for out in engine.step():
            texts[out.request_id] = texts.get(out.request_id, "") + out.text
    for i, prompt in enumerate(args.prompt):
        print(
            json.dumps(
                {"prompt": prompt, "completion": texts.get(f"cli-{i}", "")}, ensure_ascii=False
            )
        )
    return 0


def _cmd_warmup(args: argparse.Namespace) -> int:
    from dsv3serve.engine.warmup import run_warmup, write_record

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    cfg = EngineConfig.from_args(args, num_kv_tokens=args.num_kv_tokens or 8192)
    result = run_warmup(cfg, args.prompt_len, args.max_new_tokens)
    result["record"] = str(write_record(result))
    print(json.dumps(result))
    return 0


def _cmd_bench_one_batch(args: argparse.Namespace) -> int:
    from dsv3serve.bench.engine.one_batch import run_one_batch

    run_one_batch(args)
    return 0


def _cmd_bench_group(args: argparse.Namespace) -> int:
    from dsv3serve.bench.engine.group import run_group

    run_group(args)
    return 0


def _cmd_serve(args: argparse.Namespace) -> int:
    from router.launch import run

    return run(
        args.config,
        args.port,
        args.check,
        grpc_port=args.grpc_port,
        reasoning_parser=args.reasoning_parser,
        start_bound_s=args.start_timeout,
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dsv3serve")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="start a local Ray cluster and the serving app")
    serve.add_argument(
        "--config",
        type=Path,
        default=None,
        help="a Serve deploy YAML (see deploy/); default: the tiny PD app on CPU",
    )
    serve.add_argument("--port", type=int, default=None, help="HTTP port (overrides the file)")
    serve.add_argument("--grpc-port", type=int, default=None, help="gRPC port (overrides the file)")
    serve.add_argument("--check", action="store_true", help="answer one chat completion, then stop")
    serve.add_argument(
        "--reasoning-parser",
        choices=["deepseek-r1", "deepseek-v3"],
        default=None,
        help="split <think> reasoning into reasoning_content (sets router.reasoning_parser "
        "of every app in the file)",
    )
    serve.add_argument(
        "--start-timeout",
        type=float,
        default=APP_START_S,
        help=f"seconds Serve's proxy (at most {PROXY_START_S:g}) and then each app (every "
        "replica built) may take to start before serve stops and names what is not up "
        "(default %(default)g)",
    )
    _cache_arg(serve)
    serve.set_defaults(func=_cmd_serve)
    gen = sub.add_parser("generate", help="offline generation")
    _engine_args(gen)
    gen.add_argument("--prompt", action="append", required=True)
    gen.add_argument("--chat", action="store_true", help="wrap prompts in the chat template")
    gen.add_argument("--max-new-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.set_defaults(func=_cmd_generate)
    warm = sub.add_parser(
        "warmup",
        help="build the engine and run one request so the compile caches fill, then exit",
    )
    _engine_args(warm)
    warm.add_argument("--prompt-len", type=int, default=64)
    warm.add_argument("--max-new-tokens", type=int, default=4)
    warm.set_defaults(func=_cmd_warmup)
    add_plan_parser(sub)
    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench", required=True)
    one = bench.add_parser("one-batch", help="latency of one static batch (like bench_one_batch)")
    _engine_args(one)
    one.add_argument("--batch-size", type=int, nargs="+", default=[1])
    one.add_argument("--input-len", type=int, nargs="+", default=[128])
    one.add_argument("--output-len", type=int, default=16)
    one.add_argument("--json", default="bench_one_batch.json", help="where to write results")
    one.set_defaults(func=_cmd_bench_one_batch)
    grp = bench.add_parser("group", help="a sharded group's decode / prefill per GPU vs roofline")
    _engine_args(grp)
    add_group_arguments(grp)
    grp.set_defaults(func=_cmd_bench_group)
    add_serve_parser(bench)
    add_kernels_parser(bench)
    add_model_parser(bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # before any command imports flashinfer (it reads its cache variable at import)
    export_compile_caches(getattr(args, "cache_dir", None))
    try:
        return args.func(args)
    except ValueError as err:  # config / request validation: a clear message, no traceback
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
