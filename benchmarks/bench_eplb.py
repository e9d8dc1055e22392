"""Time one MoE layer's step with EPLB vs without, in the same run, and a live rebalance.

Not a test: prints a table and writes JSON (``--out``). Spawns ``--ranks`` processes (no
torchrun): NCCL on one GPU each (``--device cuda``) or gloo on CPU (``--device cpu``, a smoke
run at small sizes). Each rank holds random experts (bf16, or e4m3 with ``--fp8``) and routes
``--tokens`` tokens through DeepSeek's grouped top-k over random router logits plus a bias
that makes ``--hot`` experts hot (``--hot-bias``). Timed per row: dispatch (all-to-all) +
local experts + combine, the busiest rank's mean over ``--iters`` (after warm-up):

- ``off``: logical ids, expert ``e`` on rank ``e // (E / ranks)`` (today's layout);
- ``eplb``: ``--redundant`` extra slots placed by :func:`dsv3serve.eplb.placement.place`
  from the counts of the ``off`` rows, weights moved by :func:`rebalance` (its wall time is
  the ``rebalance_pause_s`` of the JSON: every rank waits for it between steps).

    python benchmarks/bench_eplb.py --device cuda --ranks 2 --redundant 32 --fp8 \\
        --out docs/perf/eplb_2xh200/run1_tokens256.json
    python benchmarks/bench_eplb.py --device cpu --ranks 2 --experts 16 --groups 4 \\
        --topk-groups 2 --topk 4 --hidden 64 --inter 32 --redundant 4 --tokens 32 --iters 3 \\
        --hot 2 --out /tmp/eplb_cpu.json
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dsv3serve.eplb.expert_map import ExpertMap
from dsv3serve.eplb.placement import Placement, default_placement, imbalance, place
from dsv3serve.eplb.rebalance import rebalance
from dsv3serve.eplb.state import EplbState
from dsv3serve.eplb.stats import ExpertLoad
from dsv3serve.moe import create_moe_backend
from dsv3serve.moe.experts import FusedExperts, random_experts
from dsv3serve.moe.gate import grouped_topk
from dsv3serve.moe.sharded import run_dispatched
from dsv3serve.parallel.dispatch_a2a import AllToAllDispatcher


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--groups", type=int, default=8)
    p.add_argument("--topk-groups", type=int, default=4)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--inter", type=int, default=2048)
    p.add_argument("--redundant", type=int, default=32)
    p.add_argument("--tokens", type=int, default=256, help="per rank per step")
    p.add_argument("--hot", type=int, default=8, help="experts the router bias favours")
    p.add_argument("--hot-bias", type=float, default=2.0)
    p.add_argument("--fp8", action="store_true")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--profile", type=Path, help="folder for each row's op table (torch.profiler)")
    return p.parse_args()


def route(a: argparse.Namespace, step: int, rank: int, device: torch.device):  # noqa: ANN201
    g = torch.Generator().manual_seed(1000 * step + rank)
    logits = torch.randn(a.tokens, a.experts, generator=g).to(device)
    bias = torch.zeros(a.experts, device=device)
    bias[: a.hot] = a.hot_bias  # hot experts 0.. (all on rank 0 without EPLB)
    return grouped_topk(logits, bias, a.topk, a.groups, a.topk_groups, 2.5)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def step_seconds(a, device, dispatcher, experts, state, rank, name: str) -> float:  # noqa: ANN001
    """Busiest rank's mean MoE step time over ``a.iters`` (2 warm-up steps first); with
    ``--profile``, then ``PROFILED_STEPS`` more under torch.profiler, whose op table (by
    device time, then by host time) rank 0 writes to ``--profile``/``name``.txt."""
    backend = create_moe_backend("triton" if device.type == "cuda" else "torch", a.fp8)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32

    def step(it: int) -> float:
        weights, ids = route(a, it, rank, device)
        x = torch.randn(a.tokens, a.hidden, device=device, dtype=dtype)
        sync(device)
        dist.barrier()
        t0 = time.perf_counter()
        if state is not None:
            ids = state.route(0, ids)
        run_dispatched(dispatcher, backend, x, weights, ids, experts, decode=False)
        sync(device)
        return time.perf_counter() - t0

    for it in range(2):  # warm-up
        step(it)
    total = sum(step(it) for it in range(2, a.iters + 2))
    if a.profile is not None:
        profile_steps(a, device, step, rank, a.profile / f"{name}.txt")
    slowest = torch.tensor([total / a.iters], device=device)  # NCCL reduces device tensors
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return float(slowest)


PROFILED_STEPS = 3


def profile_steps(a, device, step, rank: int, out: Path) -> None:  # noqa: ANN001
    """``PROFILED_STEPS`` steps under torch.profiler on every rank; rank 0 writes its table."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        for it in range(PROFILED_STEPS):
            step(a.iters + 2 + it)
    if rank != 0:
        return
    ops = prof.key_averages()
    by_device = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        f"{PROFILED_STEPS} steps, rank 0, by device time\n"
        + ops.table(sort_by=by_device, row_limit=25)
        + f"\n{PROFILED_STEPS} steps, rank 0, by host time\n"
        + ops.table(sort_by="self_cpu_time_total", row_limit=25)
    )


def counts(a: argparse.Namespace, rank: int, device: torch.device) -> torch.Tensor:
    load = ExpertLoad(1, a.experts, device)
    for it in range(a.iters + 2):
        load.record(0, route(a, it, rank, device)[1])
    c = load.read().to(device)  # read on the host; NCCL reduces device tensors
    dist.all_reduce(c)
    return c.cpu()


def stack(a, slots: int, device: torch.device) -> FusedExperts:  # noqa: ANN001
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(7 + dist.get_rank())
    return random_experts(slots, a.hidden, a.inter, a.fp8, dtype, str(device))


def worker(rank: int, a: argparse.Namespace, init: str) -> None:
    backend = "nccl" if a.device == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=init, rank=rank, world_size=a.ranks)
    device = torch.device(f"cuda:{rank}" if a.device == "cuda" else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    try:
        result = run(rank, a, device)
        if rank == 0:
            a.out.write_text(json.dumps(result, indent=2))
            print_table(result)
    finally:
        dist.destroy_process_group()


def run(rank: int, a: argparse.Namespace, device: torch.device) -> dict:
    e, n, p = a.experts, a.ranks, a.experts + a.redundant
    off = step_seconds(
        a, device, AllToAllDispatcher(e, None), stack(a, e // n, device), None, rank, "off"
    )
    load = counts(a, rank, device)
    start = default_placement(1, e, p, n)
    state = EplbState(ExpertMap(start, n, rank, device), None, 0)
    experts = stack(a, p // n, device)
    new: Placement = place(load.double(), p, n, a.groups)
    sync(device)
    dist.barrier()
    t0 = time.perf_counter()
    rebalance([experts.slot_tensors()], state, start.phy2log, new)
    sync(device)
    pause = time.perf_counter() - t0
    on = step_seconds(a, device, AllToAllDispatcher(p, None), experts, state, rank, "eplb")
    flat = default_placement(1, e, e, n)
    return {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items()},
        "rank_imbalance_off": imbalance(load.double(), flat, n),
        "rank_imbalance_eplb": imbalance(load.double(), new, n),
        "moe_step_s_off": off,
        "moe_step_s_eplb": on,
        "rebalance_pause_s": pause,
    }


def print_table(r: dict) -> None:
    print("| layout | max/mean rank load | MoE step (ms, busiest rank) |")
    print("|---|---|---|")
    print(f"| off | {r['rank_imbalance_off']:.3f} | {1e3 * r['moe_step_s_off']:.3f} |")
    print(f"| eplb | {r['rank_imbalance_eplb']:.3f} | {1e3 * r['moe_step_s_eplb']:.3f} |")
    print(f"rebalance pause: {1e3 * r['rebalance_pause_s']:.1f} ms")


def main() -> None:
    a = parse()
    with tempfile.TemporaryDirectory() as tmp:
        init = f"file://{tmp}/rendezvous"
        mp.start_processes(worker, args=(a, init), nprocs=a.ranks, start_method="spawn")


if __name__ == "__main__":
    main()
