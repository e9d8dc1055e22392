"""One GPU: import the built ``deep_ep``, build its buffer for a one-rank group and run
dsv3serve's start-up self-check in each mode and payload, as far as one rank allows.

    python benchmarks/deepep/check_one_gpu.py OUT.json

Prints and writes, per (mode, payload), ``passed`` or the exception it raised. One rank sends
every token to itself, so this checks the build, the buffer and the glue's shapes; traffic
between GPUs (NVLink, NVSHMEM) needs two or more (issue 16).
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist

from dsv3serve.kernels.fp8_ref import FP8_DTYPE
from dsv3serve.parallel.deepep_check import import_deep_ep, self_check
from dsv3serve.parallel.dispatch_deepep import DeepEPDispatcher, DeepEPShape

SHAPE = DeepEPShape(num_experts=32, hidden=7168, max_tokens_per_rank=128)


def check(deep_ep: object, mode: str, payload: torch.dtype | None) -> str:
    """``passed``, or the error of one build + self-check."""
    try:
        d = DeepEPDispatcher(deep_ep, SHAPE, mode, dist.group.WORLD, payload)
        self_check(d, torch.device("cuda"))
    except Exception as exc:  # recorded, not raised: the next mode still runs
        return f"{type(exc).__name__}: {str(exc)[:400]}"
    return "passed"


def main(out: str) -> int:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29531")
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    deep_ep = import_deep_ep()
    results = {"deep_ep": getattr(deep_ep, "__file__", "?"), "gpu": torch.cuda.get_device_name()}
    for mode in ("normal", "low_latency"):
        for name, payload in (("bf16", None), ("fp8", FP8_DTYPE)):
            results[f"{mode}/{name}"] = check(deep_ep, mode, payload)
            print(f"{mode:12s} {name:5s} {results[f'{mode}/{name}']}", flush=True)
    with open(out, "w") as f:
        json.dump(results, f, indent=1)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
