"""The ``dsv3serve bench model`` flags (the benchmark itself is imported when it runs)."""

from __future__ import annotations

import argparse
from typing import Any


def _run(args: argparse.Namespace) -> int:
    from dsv3serve.bench.model.run import run_bench_model

    run_bench_model(args)
    return 0


def add_model_parser(bench: Any) -> argparse.ArgumentParser:
    """Add ``model`` to the ``bench`` subparsers (``bench``: argparse's subparsers action)."""
    p = bench.add_parser("model", help="prefill / decode / MTP step costs at full width, dummy FP8")
    p.add_argument(
        "--preset", default="full", choices=["full", "small", "tiny"], help="model width"
    )
    p.add_argument("--num-moe-layers", type=int, default=None, help="default: as many as fit")
    p.add_argument("--attention-backend", default="torch", help="passed to the model runner")
    p.add_argument("--moe-backend", default="torch", help="passed to the model runner")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8_e4m3"])
    p.add_argument("--page-size", type=int, default=64)
    p.add_argument("--device", default="auto", help="auto: cuda if available, else cpu")
    p.add_argument("--quick", action="store_true", help="fewer sizes and iterations")
    p.add_argument("--prefill-lens", type=int, nargs="*", default=None)
    p.add_argument("--decode-batch-sizes", type=int, nargs="*", default=None)
    p.add_argument("--decode-contexts", type=int, nargs="+", default=None)
    p.add_argument("--mtp-batch-sizes", type=int, nargs="+", default=None)
    p.add_argument("--mtp-context", type=int, default=1024)
    p.add_argument("--mtp-steps", type=int, nargs="+", default=[1, 2, 3])
    p.add_argument("--no-mtp", action="store_true", help="no NextN layer, no MTP costs")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps per point")
    p.add_argument("--iters", type=int, default=None, help="timed steps per point")
    p.add_argument("--replays", type=int, default=10, help="timed replays per ceiling")
    p.add_argument("--reserve-gb", type=float, default=None, help="memory kept for activations")
    p.add_argument(
        "--profile-graphs",
        action="store_true",
        help="torch.profiler kernels of the graphed decode and draft steps at bs 1 (CUDA)",
    )
    p.add_argument("--out", default="bench_model.json", help="where to write the JSON")
    p.set_defaults(func=_run)
    return p
