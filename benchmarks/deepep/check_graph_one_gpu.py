"""One GPU: capture DeepEP's low-latency pair (dispatch_masked -> combine_masked) in a CUDA
graph through dsv3serve's dispatcher, and check replays against eager runs.

    python benchmarks/deepep/check_graph_one_gpu.py OUT.json

A one-rank group sends every token to itself, so this checks what a graphed decode step needs
of the glue on one GPU: the pair captures (no host sync, fixed shapes) and a replay reads the
new tokens in the captured buffers. Experts are the identity, so each token comes back as
``x * sum(weights)``. Traffic between GPUs is the multi-GPU run's (issue 16).
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist

from dsv3serve.kernels.fp8_ref import FP8_DTYPE
from dsv3serve.parallel.deepep_check import import_deep_ep
from dsv3serve.parallel.dispatch_deepep import DeepEPDispatcher, DeepEPShape

SHAPE = DeepEPShape(num_experts=32, hidden=7168, max_tokens_per_rank=128)
TOKENS, TOPK = 64, 8


def _round(d: DeepEPDispatcher, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor):
    sent = d.dispatch_masked(x, ids, w)
    return d.combine_masked(sent.rows(), sent)  # identity experts


def check(deep_ep: object, payload: torch.dtype | None) -> dict[str, object]:
    """Capture, replay 3 times with fresh tokens; the largest error against eager and the
    identity-expert reference."""
    d = DeepEPDispatcher(deep_ep, SHAPE, "low_latency", dist.group.WORLD, payload)
    dev = torch.device("cuda")
    x = torch.randn(TOKENS, SHAPE.hidden, device=dev, dtype=torch.bfloat16)
    ids = torch.stack([torch.randperm(SHAPE.num_experts, device=dev)[:TOPK] for _ in range(TOKENS)])
    w = torch.rand(TOKENS, TOPK, device=dev)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        _round(d, x, ids, w)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _round(d, x, ids, w)
    errors = []
    for _ in range(3):
        x.copy_(torch.randn_like(x))
        graph.replay()
        torch.cuda.synchronize()
        eager = _round(d, x, ids, w)
        want = x.float() * w.sum(1, keepdim=True)
        errors.append(
            {
                "vs_eager": (out.float() - eager.float()).abs().max().item(),
                "vs_reference": (out.float() - want).abs().max().item(),
                "ref_scale": want.abs().max().item(),
            }
        )
    return {"replays": errors}


def main(out: str) -> int:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    deep_ep = import_deep_ep()
    results: dict[str, object] = {"gpu": torch.cuda.get_device_name()}
    for name, payload in (("bf16", None), ("fp8", FP8_DTYPE)):
        try:
            results[name] = check(deep_ep, payload)
        except Exception as exc:  # recorded: the next payload still runs
            results[name] = f"{type(exc).__name__}: {str(exc)[:400]}"
        print(name, results[name], flush=True)
    with open(out, "w") as f:
        json.dump(results, f, indent=1)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
